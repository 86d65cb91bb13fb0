"""Losing a machine: healing in place against the restart from the checkpoint (the anchor), in the same run.

The same job twice on 3 simulated nodes x 1 rank (``cluster.min_nodes=1``), node 2 killed at step ``--at``: once
healing in place (the default), once with ``cluster.heal=false``. Printed per run: the whole job's wall time, the
time from the loss (the dying rank's log says when its fault fired) to training again (healing: to the first step
completed after it, as rank 0's log says; the restart: to the restarted rank 0's "resumed from" line, before it
trains the steps since the checkpoint again), and how many steps were trained twice. (A frozen node: healing takes
3 s; the restart path has no heartbeat and waits for the progress watch's ``comm.timeout_s``: not compared here.)

    python bench/heal.py [--at 25] [--steps 60] [--every 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run(heal: bool, args: argparse.Namespace, run_dir: Path) -> dict:
    job = [
        "+cluster=sim",
        "cluster.nodes=3",
        "cluster.procs_per_node=1",
        "cluster.min_nodes=1",
        "train.batch_size=48",
        f"train.max_steps={args.steps}",
        f"train.checkpoint_every_steps={args.every}",
        "train.log_every_steps=1",
        f"cluster.heal={str(heal).lower()}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "LAUNCHER_FAULT": f"step={args.at},rank=2,signal=KILL,target=node,attempt=0"}
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "launcher", *job], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {'healing' if heal else 'restart'} run failed:\n{done.stderr[-3000:]}")
    wall = time.time() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in records if r["kind"] == "train"]
    twice = len(trained) - len(set(trained))
    logs = run_dir / "logs"
    fired = re.search(r"^(\S+ \S+) WARNING .*LAUNCHER_FAULT: firing", (logs / "rank-2.log").read_text(), re.M)
    assert fired is not None, "the fault did not fire"
    if heal:  # the first step completed after the loss: the one that completes the lost step
        pattern = r"^(\S+ \S+) WARNING .*healed in place: the first step"
    else:  # the restarted job's rank 0 resumed from the checkpoint (before training the steps since it again)
        pattern = r"^(\S+ \S+) INFO .*resumed from"
    back = re.findall(pattern, (logs / "rank-0.log").read_text(), re.M)
    back_s = _seconds(back[-1]) - _seconds(fired.group(1))
    return {"wall_s": wall, "back_s": back_s, "trained_twice": twice}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", type=int, default=25)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(args.runs):
            for heal in (False, True):  # the anchor first in each pair
                rows.append((heal, run(heal, args, Path(tmp) / f"{n}-{heal}")))
    print(
        f"3 simulated nodes x 1 rank, node 2 killed at step {args.at} of {args.steps}, checkpoints every {args.every}"
    )
    print(f"{'way':<10} {'wall s':>8} {'loss->step s':>13} {'steps twice':>12}")
    for heal, r in rows:
        print(f"{'heal' if heal else 'restart':<10} {r['wall_s']:8.2f} {r['back_s']:13.2f} {r['trained_twice']:12d}")
    for key in ("wall_s", "back_s"):
        ratios = [b[1][key] / a[1][key] for a, b in zip(rows[::2], rows[1::2])]
        print(f"heal / restart, {key}: " + ", ".join(f"{x:.2f}" for x in ratios))


if __name__ == "__main__":
    main()
