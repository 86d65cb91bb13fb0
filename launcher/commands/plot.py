"""Curves from a run directory: ``plot_run(run_dir)`` reads ``metrics.jsonl`` (and ``summary.json`` if the
run finished) and writes ``run_dir/plots/curves.png``: training/test loss (named by the loss in use), the test
metrics by name (accuracy, train.metrics), throughput, and time per step split into compute and exposed gradient
communication. Works on a running run too. ``plot_trace(run_dir)`` draws ``trace.json`` (``comm.trace=true``) as
``run_dir/plots/trace.png``: one lane per rank and track; ``plot_all(run_dir)`` writes both."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import yaml

from launcher.base.run_dir import RunDir
from launcher.report.summary import RunSummary

log = logging.getLogger(__name__)

Record = dict[str, Any]


def load_metrics(run_dir: RunDir) -> tuple[list[Record], list[Record]]:
    """Train and eval records of ``run_dir/metrics.jsonl``, each sorted by step. A resumed run re-logs
    steps into the same file: the last record for each (kind, step) wins. Unparsable lines (a killed
    run's truncated last line) are skipped with a warning. Raises ValueError if there is nothing to read."""
    path = run_dir.metrics
    hint = (
        f"no metrics in {path}: is {run_dir} a launcher run dir? Runs write metrics.jsonl after the "
        "first train.log_every_steps steps"
    )
    if not path.is_file():
        raise ValueError(hint)
    latest: dict[tuple[str, int], Record] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (rec["kind"], int(rec["step"]))
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("%s:%d: skipping unreadable line (%s)", path, lineno, exc)
                continue
            latest[key] = rec
    if not latest:
        raise ValueError(hint)
    train = sorted((r for (k, _), r in latest.items() if k == "train"), key=lambda r: int(r["step"]))
    evals = sorted((r for (k, _), r in latest.items() if k == "eval"), key=lambda r: int(r["step"]))
    return train, evals


def run_title(summary: Optional[RunSummary]) -> str:
    """E.g. ``LeNet · digits · 2 nodes × 2 ranks · bucketed, hierarchical`` from ``summary.json``."""
    if summary is None:
        return ""
    s, plural = summary, lambda n: "s" if n != 1 else ""
    parts = [s.model.rsplit(".", 1)[-1], s.data]
    parts.append(f"{s.nodes} node{plural(s.nodes)} × {s.procs_per_node} rank{plural(s.procs_per_node)}")
    parts.append(s.reducer + (", hierarchical" if s.hierarchical else ""))
    return " · ".join(p for p in parts if p)


def reducer_run(run_dir: RunDir, summary: Optional[RunSummary]) -> str:
    """The ``comm.reducer`` the run ran: its summary's, else (a run still going) its frozen config's; "" unknown."""
    if summary is not None:
        return summary.reducer
    try:
        comm = (yaml.safe_load(run_dir.config.read_text(encoding="utf-8")) or {}).get("comm") or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return ""
    return str(comm.get("reducer") or "") if isinstance(comm, dict) else ""


def unmeasured_note(reducer: str) -> str:
    """The time panel's note where no step recorded its exposed communication (torch DDP's, a flat FSDP2 group's
    collectives run inside its hooks: no wait of ours to time), naming the reducer that ran."""
    return "exposed communication not measured" + (f" (comm.reducer={reducer})" if reducer else "")


def _xy(records: list[Record], key: str, x: str = "step", scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(x, scale*key) over the records that have ``key`` (older or partial records may lack a field)."""
    have = [r for r in records if isinstance(r.get(key), (int, float)) and x in r]
    return [float(r[x]) for r in have], [scale * float(r[key]) for r in have]


def score_names(evals: list[Record]) -> list[str]:
    """The metrics the evaluations reported, by name (``test_<name>`` but the loss), in their first order."""
    keys = dict.fromkeys(key for record in evals for key in record)
    return [k.removeprefix("test_") for k in keys if k.startswith("test_") and k != "test_loss"]


def plot_run(run_dir: RunDir) -> Path:
    """Render the 2×2 curves of ``run_dir`` into ``run_dir/plots/curves.png`` and return that path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train, evals = load_metrics(run_dir)
    summary = RunSummary.read(run_dir)
    fig = Figure(figsize=(11, 8), dpi=110)
    FigureCanvasAgg(fig)
    (ax_loss, ax_acc), (ax_tput, ax_time) = fig.subplots(2, 2)

    line = "-" if len(train) > 3 else "o-"  # a run with a few logged steps still shows its points
    if train:
        ax_loss.plot(*_xy(train, "loss"), line, label="train loss")
    if evals:
        ax_loss.plot(*_xy(evals, "test_loss"), "o", label="test loss")
    loss = summary.loss if summary is not None else "train.loss"  # the loss in use, by its name
    ax_loss.set(title="Loss", xlabel="step", ylabel=f"loss ({loss.replace('_', '-')})")
    ax_loss.legend()

    ax_acc.set(title="Test metrics", xlabel="epoch", ylabel="value (each under its name)")
    names = score_names(evals)
    for name in names:  # accuracy where it was computed, every train.metrics by its name
        ax_acc.plot(*_xy(evals, f"test_{name}", x="epoch"), "o-", label=f"test {name}")
    if names:
        ax_acc.legend()
    else:
        what = "no evaluation yet" if not evals else "no test metric (train.loss=model: train.metrics)"
        ax_acc.text(0.5, 0.5, what, ha="center", va="center", transform=ax_acc.transAxes)

    if train:
        ax_tput.plot(*_xy(train, "samples_per_s"), line, label="throughput")
        ax_tput.legend()
    ax_tput.set(title="Throughput", xlabel="step", ylabel="samples/s (global)")

    ax_time.set(title="Time per step", xlabel="step", ylabel="time per step (ms)")
    comm = [r for r in train if isinstance(r.get("comm_exposed_s"), (int, float)) and "step_s" in r]
    if comm:
        steps, exposed = _xy(comm, "comm_exposed_s", scale=1e3)
        compute = [max(1e3 * float(r["step_s"]) - e, 0.0) for r, e in zip(comm, exposed)]
        if len(steps) > 3:
            ax_time.stackplot(steps, compute, exposed, labels=["compute", "exposed communication"], alpha=0.8)
        else:  # an area needs several points: bars
            ax_time.bar(steps, compute, label="compute", alpha=0.8)
            ax_time.bar(steps, exposed, bottom=compute, label="exposed communication", alpha=0.8)
    elif train:
        ax_time.plot(*_xy(train, "step_s", scale=1e3), line, label="step time (compute + communication)")
        note = unmeasured_note(reducer_run(run_dir, summary))
        ax_time.text(0.5, 0.5, note, ha="center", va="center", transform=ax_time.transAxes)
    if train:
        ax_time.set_ylim(bottom=0)
        ax_time.legend(loc="lower right")
    else:
        for ax in (ax_tput, ax_time):
            ax.text(0.5, 0.5, "no training steps logged yet", ha="center", va="center", transform=ax.transAxes)

    title = run_title(summary)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = run_dir.curves_plot
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


_TRACE_COLOURS = {
    "forward": "tab:blue",
    "backward": "tab:orange",
    "optimizer": "tab:green",
    "wait for buckets": "tab:red",
    "reduce": "tab:purple",
    "allreduce": "tab:brown",
    "broadcast": "tab:pink",
}
_OTHER_COLOURS = ("tab:gray", "tab:olive", "tab:cyan")
Lane = list[tuple[str, float, float]]  # (event name, start ms, duration ms)


def _trace_lanes(path: Path) -> tuple[list[str], list[Lane]]:
    """Lane labels ``rank R · track`` (ranks in order, tracks by sort index) and each lane's events, in ms
    from the first event."""
    events = json.loads(path.read_text(encoding="utf-8")).get("traceEvents", [])
    track: dict[tuple[int, int], str] = {}
    order: dict[tuple[int, Any], float] = {}  # (pid, None) is the rank's own sort index
    for e in (e for e in events if e.get("ph") == "M"):
        key, value = (e.get("pid", 0), e.get("tid")), e.get("args", {})
        if e.get("name") == "thread_name":
            track[key] = str(value.get("name"))
        elif e.get("name") in ("thread_sort_index", "process_sort_index"):
            order[key] = float(value.get("sort_index", 0))
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ValueError(f"no events in {path}: was the run stopped before its trace window ended?")
    t0 = min(float(e["ts"]) for e in spans)
    lanes: dict[tuple[int, int], Lane] = {}
    for e in spans:
        lanes.setdefault((e.get("pid", 0), e.get("tid", 0)), []).append(
            (str(e["name"]), (float(e["ts"]) - t0) / 1e3, float(e.get("dur", 0.0)) / 1e3)
        )
    keys = sorted(lanes, key=lambda k: (order.get((k[0], None), k[0]), k[0], order.get(k, k[1]), k[1]))
    return [f"rank {p} · {track.get((p, t), f'track {t}')}" for p, t in keys], [lanes[k] for k in keys]


def _kind(event: str) -> str:
    """An event's kind: "bucket 3" -> "bucket"."""
    return event.rstrip("0123456789 ")


def plot_trace(run_dir: RunDir) -> Path:
    """Render ``run_dir/trace.json`` as a timeline into ``run_dir/plots/trace.png`` and return that path.
    Events nested in one of another kind (``wait for buckets`` in ``backward``) are drawn thinner and hatched
    on top; overlapping events of one kind (buckets in flight together) semi-transparent."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = run_dir.trace
    if not path.is_file():
        raise ValueError(f"no trace in {path}: run with comm.trace=true to record one")
    labels, lanes = _trace_lanes(path)
    names = {n for lane in lanes for n, _, _ in lane}
    buckets = sorted((n for n in names if n.startswith("bucket ")), key=lambda n: (len(n), n))  # bucket 2 < 10
    colours: dict[str, Any] = {n: c for n, c in _TRACE_COLOURS.items() if n in names}
    colours.update({b: colormaps["viridis"](i / max(len(buckets) - 1, 1)) for i, b in enumerate(buckets)})
    for i, n in enumerate(sorted(names - colours.keys())):
        colours[n] = _OTHER_COLOURS[i % len(_OTHER_COLOURS)]

    fig = Figure(figsize=(12, 1.6 + 0.45 * len(lanes)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for y, lane in enumerate(lanes):
        groups: dict[tuple[str, bool, bool], list[tuple[float, float]]] = {}
        for i, (name, start, dur) in enumerate(lane):  # kind: "bucket 3" -> "bucket"
            kind, end = _kind(name), start + dur
            nested = any(s <= start and end <= s + d and d > dur and _kind(n) != kind for n, s, d in lane)
            partial = any(j != i and s < end and start < s + d and _kind(n) == kind for j, (n, s, d) in enumerate(lane))
            groups.setdefault((name, nested, partial), []).append((start, dur))
        for (name, nested, partial), bars in sorted(groups.items(), key=lambda g: g[0][1]):  # nested on top
            h = 0.4 if nested else 0.8
            ax.broken_barh(
                bars,
                (y - h / 2, h),
                facecolors=colours[name],
                alpha=0.55 if partial else 0.9,
                edgecolor="black",
                linewidth=0.3,
                hatch="////" if nested else None,
            )
    ax.set_yticks(range(len(lanes)), labels)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # first rank's first track on top
    ax.set_xlim(0, max(s + d for lane in lanes for _, s, d in lane) * 1.01 or 1.0)
    run = run_title(RunSummary.read(run_dir))
    ax.set(
        xlabel="time from the first event (ms)",
        title="communication timeline (comm.trace)" + (f"\n{run}" if run else ""),
    )
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[
            Patch(
                facecolor=c,
                edgecolor="black",
                linewidth=0.3,
                label=n,
                hatch="////" if n == "wait for buckets" else None,
            )
            for n, c in colours.items()
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize="small",
        frameon=False,
    )
    out = run_dir.trace_plot
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", bbox_inches="tight")
    return out


def plot_all(run_dir: RunDir) -> list[Path]:
    """``plots/curves.png`` and, if the run recorded ``trace.json``, ``plots/trace.png``: the paths written."""
    return [plot_run(run_dir)] + ([plot_trace(run_dir)] if run_dir.trace.is_file() else [])
