"""Accuracy guard for ``comm.compress``: what compression costs in test accuracy, over paired seeds.

    python bench/compression_accuracy.py [--seeds 5] [--json PATH]

The default job (LeNet on the bundled digits, 10 epochs) on 2 simulated nodes x 2 ranks (``+cluster=sim``), once
per seed and variant: ``none``, ``bf16`` and ``powersgd`` (our reducer at its defaults), and ``torch-powersgd``
(torch DDP with torch's own ``powerSGD_hook``, one bucket, the same rank and warm-up: bench/torch_hook). A seed
fixes the initial weights and the data order, so each compressed run is paired with the uncompressed run of its
seed. Prints each run's test accuracy, then per variant the median and the worst paired difference (points,
compressed minus none) against issue 38's bounds: median >= -0.5 (bf16) / -1.0 (PowerSGD), none below -3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, table

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {  # name: (overrides, extra environment)
    "none": ((), {}),
    "bf16": (("comm.compress=bf16",), {}),
    "powersgd": (("comm.compress=powersgd",), {}),
    "torch-powersgd": (
        ("comm.reducer=ddp", "comm.compress=powersgd", "comm.bucket_cap_mb=64"),
        {"LAUNCHER_BENCH_TORCH_POWERSGD": "1", "PYTHONPATH": str(REPO / "bench" / "torch_hook")},
    ),
}
BOUNDS = {"bf16": -0.5, "powersgd": -1.0, "torch-powersgd": -1.0}  # the median paired difference, points
WORST = -3.0


def run(seed: int, name: str, run_dir: Path) -> float:
    overrides, extra = VARIANTS[name]
    cmd = [sys.executable, "-m", "launcher", "+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2"]
    cmd += [f"train.seed={seed}", "train.plots=false", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, **extra}
    if "PYTHONPATH" in extra and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = f"{extra['PYTHONPATH']}{os.pathsep}{os.environ['PYTHONPATH']}"
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    if extra and "powerSGD_hook registered" not in (run_dir / "logs" / "rank-1.log").read_text():
        raise SystemExit(f"{name}: torch's hook was not registered (bench/torch_hook/sitecustomize.py not loaded)")
    summary = json.loads((run_dir / "summary.json").read_text())
    if name != "none" and "PowerSGD" not in summary["compression"] and "bf16" not in summary["compression"]:
        raise SystemExit(f"{name}: the run says it compressed nothing: {summary['compression']!r}")
    return 100.0 * summary["test_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    accuracy: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for name in VARIANTS:
                accuracy[name].append(run(seed, name, Path(tmp) / f"{seed}-{name}"))
            print(f"# seed {seed}: " + ", ".join(f"{n} {a[-1]:.2f}" for n, a in accuracy.items()), flush=True)
    rows, ok = [], True
    for name, bound in BOUNDS.items():
        diffs = [a - b for a, b in zip(accuracy[name], accuracy["none"])]
        median, worst = statistics.median(diffs), min(diffs)
        passed = median >= bound and worst >= WORST
        ok &= passed
        rows.append([name, statistics.median(accuracy[name]), median, worst, f">= {bound} / >= {WORST}", passed])
    print(f"# default job (LeNet, digits), 2 simulated nodes x 2 ranks, {args.seeds} paired seeds; {machine()}")
    print(f"# none: median test accuracy {statistics.median(accuracy['none']):.2f} %")
    print(table(["variant", "median acc %", "median diff", "worst diff", "bounds", "within"], rows))
    if args.json:
        args.json.write_text(json.dumps(accuracy, indent=2))
    if not ok:
        raise SystemExit("outside issue 38's bounds")


if __name__ == "__main__":
    main()
