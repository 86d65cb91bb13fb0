"""Curves from a run directory: ``plot_run(run_dir)`` reads ``metrics.jsonl`` (and ``summary.json`` if the
run finished) and writes ``run_dir/plots/curves.png``: training/test loss, test accuracy, throughput, and
time per step split into compute and exposed gradient communication. Works on a running run too."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Record = dict[str, Any]
_NO_COMM = "exposed communication not measured (comm.reducer=ddp)"


def load_metrics(run_dir: str | Path) -> tuple[list[Record], list[Record]]:
    """Train and eval records of ``run_dir/metrics.jsonl``, each sorted by step. A resumed run re-logs
    steps into the same file: the last record for each (kind, step) wins. Unparsable lines (a killed
    run's truncated last line) are skipped with a warning. Raises ValueError if there is nothing to read."""
    path = Path(run_dir) / "metrics.jsonl"
    hint = (f"no metrics in {path}: is {run_dir} a launcher run dir? Runs write metrics.jsonl after the "
            "first train.log_every_steps steps")
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


def run_title(summary: Record) -> str:
    """E.g. ``LeNet · digits · 2 nodes × 2 ranks · bucketed, hierarchical`` from ``summary.json``."""
    parts: list[str] = []
    if summary.get("model"):
        parts.append(str(summary["model"]).rsplit(".", 1)[-1])
    if summary.get("data"):
        parts.append(str(summary["data"]))
    nodes, per_node = summary.get("nodes"), summary.get("procs_per_node")
    if nodes is not None and per_node is not None:
        parts.append(f"{nodes} node{'s' if nodes != 1 else ''} × {per_node} rank{'s' if per_node != 1 else ''}")
    elif summary.get("world_size") is not None:
        n = summary["world_size"]
        parts.append(f"{n} rank{'s' if n != 1 else ''}")
    if summary.get("reducer"):
        parts.append(str(summary["reducer"]) + (", hierarchical" if summary.get("hierarchical") else ""))
    return " · ".join(parts)


def _read_summary(run_dir: Path) -> Record:
    try:
        data = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", run_dir / "summary.json", exc)
        return {}
    return data if isinstance(data, dict) else {}


def _xy(records: list[Record], key: str, x: str = "step", scale: float = 1.0) -> tuple[list[float], list[float]]:
    """(x, scale*key) over the records that have ``key`` (older or partial records may lack a field)."""
    have = [r for r in records if isinstance(r.get(key), (int, float)) and x in r]
    return [float(r[x]) for r in have], [scale * float(r[key]) for r in have]


def plot_run(run_dir: str | Path) -> Path:
    """Render the 2×2 curves of ``run_dir`` into ``run_dir/plots/curves.png`` and return that path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    train, evals = load_metrics(run_dir)
    fig = Figure(figsize=(11, 8), dpi=110)
    FigureCanvasAgg(fig)
    (ax_loss, ax_acc), (ax_tput, ax_time) = fig.subplots(2, 2)

    if train:
        ax_loss.plot(*_xy(train, "loss"), label="train loss")
    if evals:
        ax_loss.plot(*_xy(evals, "test_loss"), "o", label="test loss")
    ax_loss.set(title="Loss", xlabel="step", ylabel="loss (cross-entropy)")
    ax_loss.legend()

    ax_acc.set(title="Test accuracy", xlabel="epoch", ylabel="test accuracy (%)")
    if evals:
        ax_acc.plot(*_xy(evals, "test_accuracy", x="epoch", scale=100.0), "o-", label="test accuracy")
        ax_acc.legend()
    else:
        ax_acc.text(0.5, 0.5, "no evaluation yet", ha="center", va="center", transform=ax_acc.transAxes)

    if train:
        ax_tput.plot(*_xy(train, "samples_per_s"), label="throughput")
        ax_tput.legend()
    ax_tput.set(title="Throughput", xlabel="step", ylabel="samples/s (global)")

    ax_time.set(title="Time per step", xlabel="step", ylabel="time per step (ms)")
    comm = [r for r in train if isinstance(r.get("comm_exposed_s"), (int, float)) and "step_s" in r]
    if comm:
        steps, exposed = _xy(comm, "comm_exposed_s", scale=1e3)
        compute = [max(1e3 * float(r["step_s"]) - e, 0.0) for r, e in zip(comm, exposed)]
        ax_time.stackplot(steps, compute, exposed, labels=["compute", "exposed communication"], alpha=0.8)
    elif train:
        ax_time.plot(*_xy(train, "step_s", scale=1e3), label="step time (compute + communication)")
        ax_time.text(0.5, 0.5, _NO_COMM, ha="center", va="center", transform=ax_time.transAxes)
    if train:
        ax_time.set_ylim(bottom=0)
        ax_time.legend(loc="lower right")
    else:
        for ax in (ax_tput, ax_time):
            ax.text(0.5, 0.5, "no training steps logged yet", ha="center", va="center", transform=ax.transAxes)

    title = run_title(_read_summary(run_dir))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = run_dir / "plots" / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
