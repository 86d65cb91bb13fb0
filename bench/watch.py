"""What the progress watch (launcher/watch) costs: the trainer run with the watch off (``comm.hang_warn_s=0``) and
on (the default), interleaved, on the same machine in the same run.

Two figures: the samples/s of the run, on vs off (the anchor: the same job without the watch, measured between
the runs with it), and the time the watch thread itself worked per rank (``busy_s`` of its last progress) as a
share of the run's wall time: an upper bound of what it takes from a step (it runs beside the step, mostly
outside the GIL-holding parts, on a core the step may not use).

    .venv/bin/python bench/watch.py --pairs 3 --steps 600
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(run_dir: Path, steps: int, watch: bool) -> tuple[float, float, list[float]]:
    """(samples/s, wall s, each rank's watch busy s) of one training run."""
    overrides = [f"hydra.run.dir={run_dir}", f"train.max_steps={steps}", "train.epochs=1000"]
    overrides += ["train.checkpoint_every_steps=0", f"comm.hang_warn_s={60 if watch else 0}"]
    done = subprocess.run([sys.executable, "-m", "launcher", *overrides], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    summary = json.loads((run_dir / "summary.json").read_text())
    files = [p for p in sorted(run_dir.glob("watch/*/attempt-0/rank-*.json")) if p.name.count(".") == 1]
    busy = [json.loads(p.read_text()).get("busy_s", 0.0) for p in files]
    return summary["samples_per_s"], summary["wall_s"], busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    rates: dict[bool, list[float]] = {False: [], True: []}
    shares: list[float] = []
    print("run | watch | samples/s | wall s | watch busy s per rank | busy / wall")
    print("----|-------|-----------|--------|-----------------------|------------")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2 * args.pairs):
            watch = (i % 2 == 1) if (i // 2) % 2 == 0 else (i % 2 == 0)  # off,on then on,off: no order bias
            rate, wall, busy = run(Path(tmp) / f"run-{i}", args.steps, watch)
            rates[watch].append(rate)
            share = max(busy) / wall if busy else 0.0
            if watch:
                shares.append(share)
            shown = ", ".join(f"{b:.3f}" for b in busy) if watch else "-"
            print(
                f"{i:3d} | {'on ' if watch else 'off'}   | {rate:9.0f} | {wall:6.2f} | {shown:21s} | "
                f"{100 * share:.2f} %"
                if watch
                else f"{i:3d} | off   | {rate:9.0f} | {wall:6.2f} | - | -"
            )
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(
        f"samples/s on / off (medians) = {on / off:.3f}; watch busy / wall (max rank, median) = "
        f"{100 * statistics.median(shares):.2f} %"
    )


if __name__ == "__main__":
    main()
