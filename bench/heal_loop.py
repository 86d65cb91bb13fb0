"""Healing your own loop: a machine lost under a loop through ``launcher.Engine`` (bench/heal_loop_job.py), with the
built-in trainer as the anchor, on 3, 6 and 12 simulated nodes of one rank, in the same run.

Each job (``python -m launcher +cluster=sim cluster.nodes=N cluster.min_nodes=N-1 cluster.procs_per_node=1``, LeNet,
``--steps`` steps, a global batch that splits over N and N-1 ranks: 48, 60, 132 on 3, 6, 12 nodes, i.e. 16, 10, 11
per rank, or ``--batch``; the trainer evaluates at the end only) loses node 1 before step ``--at`` (its work not
begun), one of three ways:

- ``kill``: ``LAUNCHER_FAULT=step=AT,rank=1,signal=KILL,target=node`` (its agent and ranks SIGKILLed);
- ``freeze``: the same with ``signal=STOP`` (the node frozen: lost once its heartbeat is silent ``lost_after_s``);
- ``cut``: ``cluster.netns=true`` and node 1's link set down (``ip -n NS link set IF down``) by this script once the
  job completed step AT-1; rank 1 is held at step AT meanwhile by ``LAUNCHER_FAULT=...,delay=D,while=PATH`` (so the
  cut comes before step AT on every rank), and the link is set up again if the namespace outlives the job.

Measured per job (survivors: every rank but rank 1; all times are this machine's clock):

- ``fault->step``: membership.jsonl's ``fault_to_step_s`` (the launcher's: from the loss, the earliest it can have
  happened, i.e. the lost node's last heartbeat, to the first step completed after it);
- ``loss->step``: the same from this script's side: from the loss (the dying rank's "LAUNCHER_FAULT: firing" log
  line; for a cut, the clock just before the link went down) to the first step completed after it (the engine
  loop's rank 0 prints a time.time() per step; the trainer's rank 0 logs "healed in place ... completed" then);
- step time: the median of the 10 steps before the loss and the 10 after the healing step (the loop's per-step
  stamps; the trainer's per-step ``step_s`` in metrics.jsonl, ``train.log_every_steps=1``); steps/s of the 10
  steps before the loss and of the 10 after the healing step;
- heal extra steps: (``loss->step`` - median step) / median step (the healing step, counted from the loss, less
  one ordinary step, in steps), and its ratio at the most nodes to the fewest;
- steps trained twice (a step number seen twice in one survivor's step lines; the trainer: in metrics.jsonl) and
  checkpoints read ("resumed from" in any log or the console, summary.json's ``resumed_from``).

    python bench/heal_loop.py [--nodes 3,6,12] [--faults kill,freeze,cut] [--kinds engine,trainer] [--runs 1]
        [--steps 35] [--at 15] [--batch B] [--timeout 180] [--reprint FILE] [--json FILE] [--keep DIR]

Each job runs under a timeout (``--timeout`` s: SIGTERM to the launcher, then SIGKILL to what is left); a failed job
is reported as such and the others go on. Every process the job started is gone after it (checked: any left is
killed and reported), and every namespace it made (the launcher deletes them; any left is deleted and reported).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, table  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from heal_loop_jobs import _p95, global_batch, run_job  # noqa: E402


def _rows(jobs: list[dict], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for kind in args.kinds:
        for fault in args.faults:
            for nodes in args.nodes:
                mine = [j for j in jobs if (j["kind"], j["fault"], j["nodes"]) == (kind, fault, nodes)]
                ok = [j for j in mine if "error" not in j]
                row: dict[str, Any] = {"kind": kind, "fault": fault, "nodes": nodes, "batch": global_batch(nodes, args)}
                row.update(runs=len(mine), ok=len(ok))
                if ok:

                    def med(key: str, runs: list[dict] = ok) -> float:
                        return statistics.median(j[key] for j in runs)

                    f2s = [j["fault_to_step_s"] for j in ok]
                    l2s = [j["loss_to_step_s"] for j in ok]
                    row.update(
                        fault_to_step_med=statistics.median(f2s),
                        fault_to_step_p95=_p95(f2s),
                        fault_to_step_max=max(f2s),
                        loss_to_step_med=statistics.median(l2s),
                        loss_to_step_p95=_p95(l2s),
                        step_ms=med("step_s") * 1e3,
                        heal_extra_steps=med("heal_extra_steps"),
                        steps_per_s_before=med("steps_per_s_before"),
                        steps_per_s_after=med("steps_per_s_after"),
                        steps_twice=sum(j["steps_twice"] for j in ok),
                        steps_missing=sum(j["steps_missing"] for j in ok),
                        checkpoints_read=sum(j["checkpoints_read"] for j in ok),
                    )
                    row["after_over_before"] = row["steps_per_s_after"] / row["steps_per_s_before"]
                rows.append(row)
    for row in rows:  # the heal's extra steps against the fewest nodes' (same kind and fault)
        base = next(
            r for r in rows if (r["kind"], r["fault"], r["nodes"]) == (row["kind"], row["fault"], args.nodes[0])
        )
        if "heal_extra_steps" in row and base.get("heal_extra_steps", 0) > 0:
            row["extra_over_fewest"] = row["heal_extra_steps"] / base["heal_extra_steps"]
    return rows


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _met(row: dict[str, Any], figure: Optional[float], limit: float) -> Optional[bool]:
    """Met, not met (a failed run fails the goal too), or None: nothing measured."""
    if row["ok"] < row["runs"]:
        return False
    return None if figure is None else figure <= limit


def _goals(rows: list[dict], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each goal per kind and fault: the figure, the limit, met or not (None: not measured)."""
    goals = []
    most, fewest = args.nodes[-1], args.nodes[0]
    for row in rows:
        limit = 5.0 if row["fault"] == "kill" else args.lost_after + 3.0
        figure = row.get("fault_to_step_p95") if row.get("ok", 0) > 1 else row.get("fault_to_step_max")
        what = "p95" if row.get("ok", 0) > 1 else "max"
        goals.append(
            {
                "goal": f"{row['kind']} {row['fault']} {row['nodes']} nodes: fault->step {what} <= {limit:g} s",
                "figure": figure,
                "met": _met(row, figure, limit),
            }
        )
    for row in rows:
        if row["nodes"] == most and most != fewest:
            figure = row.get("extra_over_fewest")
            goals.append(
                {
                    "goal": f"{row['kind']} {row['fault']}: heal extra steps {most} / {fewest} nodes <= 1.25",
                    "figure": figure,
                    "met": _met(row, figure, 1.25),
                }
            )
    for key, name in (("steps_twice", "steps trained twice"), ("checkpoints_read", "checkpoints read")):
        total = sum(r.get(key, 0) for r in rows)
        ok = sum(r["ok"] for r in rows)
        met = None if ok == 0 else total == 0
        goals.append({"goal": f"{name} (the {ok} measured jobs) == 0", "figure": total, "met": met})
    return goals


def run_jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every job, in order: runs outermost, then nodes, faults, kinds (engine and trainer in pairs)."""
    jobs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="heal_loop-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for run in range(args.runs):
            for nodes in args.nodes:
                for fault in args.faults:
                    for kind in args.kinds:
                        job = run_job(kind, nodes, fault, args, root / f"{kind}-{fault}-{nodes}-{run}")
                        jobs.append(job)
                        said = job.get("error") or (
                            f"fault->step {job['fault_to_step_s']:.2f} s, loss->step {job['loss_to_step_s']:.2f} s, "
                            f"step {job['step_s'] * 1e3:.1f} ms, twice {job['steps_twice']}, "
                            f"read {job['checkpoints_read']}, missing {job['steps_missing']}"
                        )
                        extra = f" [{'; '.join(job['problems'])}]" if job.get("problems") else ""
                        print(
                            f"# {kind} {fault} {nodes} nodes run {run}: {said} ({job['wall_s']:.0f} s, load "
                            f"{job['load_before_after'][0]:.1f}){extra}"
                        )
                        sys.stdout.flush()
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="3,6,12", help="simulated nodes (1 rank each), comma separated")
    parser.add_argument("--faults", default="kill,freeze,cut", help="kill, freeze, cut (cut needs root)")
    parser.add_argument("--kinds", default="engine,trainer", help="engine (bench/heal_loop_job.py), trainer")
    parser.add_argument("--runs", type=int, default=1, help="repeats of each job")
    parser.add_argument("--steps", type=int, default=35)
    parser.add_argument("--batch", type=int, default=0, help="global batch (default: 48, 60, 132 on 3, 6, 12 nodes)")
    parser.add_argument("--at", type=int, default=15, help="node 1 is lost before this step")
    parser.add_argument("--lost-after", type=float, default=3.0, help="cluster.lost_after_s")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per job before it is ended")
    parser.add_argument("--json", type=Path, help="write every job and row here")
    parser.add_argument("--reprint", type=Path, help="no jobs: print the table of a --json FILE's jobs again")
    parser.add_argument("--keep", type=Path, help="keep the run dirs here (default: a temporary folder, removed)")
    args = parser.parse_args()
    args.nodes = sorted(int(n) for n in args.nodes.split(","))
    args.faults = [f for f in args.faults.split(",") if f]
    args.kinds = [k for k in args.kinds.split(",") if k]
    assert set(args.faults) <= {"kill", "freeze", "cut"} and set(args.kinds) <= {"engine", "trainer"}
    assert min(args.nodes) >= 3 and 12 <= args.at <= args.steps - 10, "needs 3+ nodes, 11 steps before, 10 after"
    # (the engine's 10 steps before the loss are timed from stamp to stamp: the first of them needs one before it)
    if "cut" in args.faults and (os.geteuid() != 0 or shutil.which("ip") is None):
        raise SystemExit("--faults cut needs root and iproute2 (cluster.netns=true)")

    if args.reprint:  # the jobs and the settings they ran with
        kept = json.loads(args.reprint.read_text())
        for key in ("nodes", "faults", "kinds", "runs", "steps", "at", "batch", "lost_after"):
            setattr(args, key, kept["settings"][key])
    print(
        f"# heal_loop: node 1 of N lost before step {args.at} of {args.steps}, 1 rank per node, global batch "
        f"{', '.join(str(global_batch(n, args)) for n in args.nodes)} on {', '.join(map(str, args.nodes))} nodes, "
        f"lost_after_s={args.lost_after:g}; {machine()}, gloo",
        flush=True,
    )
    jobs = kept["jobs"] if args.reprint else run_jobs(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "keep", "reprint")}
    settings["machine"] = machine()
    if args.json:  # the jobs first: whatever follows, they are kept
        args.json.write_text(json.dumps({"settings": settings, "jobs": jobs}, indent=1))
    rows = _rows(jobs, args)
    headers = [
        "kind", "fault", "nodes", "batch", "ok", "fault->step s", "p95", "loss->step s", "step ms", "heal extra steps",
        f"/ {args.nodes[0]} nodes", "steps/s before", "after", "after/before", "twice", "ckpt read",
    ]  # fmt: skip
    cells = [
        [
            r["kind"],
            r["fault"],
            r["nodes"],
            r["batch"],
            f"{r['ok']}/{r['runs']}",
            _fmt(r.get("fault_to_step_med")),
            _fmt(r.get("fault_to_step_p95")),
            _fmt(r.get("loss_to_step_med")),
            _fmt(r.get("step_ms"), 1),
            _fmt(r.get("heal_extra_steps"), 1),
            _fmt(r.get("extra_over_fewest")),
            _fmt(r.get("steps_per_s_before"), 1),
            _fmt(r.get("steps_per_s_after"), 1),
            _fmt(r.get("after_over_before")),
            _fmt(r.get("steps_twice")),
            _fmt(r.get("checkpoints_read")),
        ]
        for r in rows
    ]
    print(table(headers, cells))
    goals = _goals(rows, args)
    print("# goals")
    for g in goals:
        mark = {True: "met", False: "NOT met", None: "not measured"}[g["met"]]
        print(f"{g['goal']}: {_fmt(g['figure'])} -> {mark}")
    failed = [j for j in jobs if "error" in j]
    for j in failed:
        print(f"# FAILED {j['kind']} {j['fault']} {j['nodes']} nodes: {j['error']}\n#   {j['command']}")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "rows": rows, "goals": goals, "jobs": jobs}, indent=1))


if __name__ == "__main__":
    main()
