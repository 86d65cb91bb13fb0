"""Checkpoint benchmark: what a save costs the training loop, written synchronously or in the background
(``train.checkpoint_async``), issue 50.

    python bench/checkpoint.py [--steps 40] [--every 5] [--hidden 2048] [--reducer ddp] [--ranks 2] [--json PATH]

Runs the launcher's trainer three times on 2 local ranks (``--ranks``; one thread each): an MLP of ``--hidden`` x 6
layers (hidden 2048: 22.6 M parameters, 181 MB of state with SGD's momentum) on synthetic data, ``--steps`` steps, a
checkpoint every ``--every`` steps (``none``: only the end's, outside the timed windows), sync and async. Reported:
``blocked_ms``: the time the loop waited inside each save (the trainer's ``kind: checkpoint`` records in
metrics.jsonl, rank 0's; the median over the saves); ``step_ms``: the mean step over the logged windows after the
first (saves included: a window's time runs from one log to the next). Ratios against the synchronous save measured
in the same run."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, table

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"none": ("train.checkpoint_every_steps=0",), "sync": (), "async": ("train.checkpoint_async=true",)}


def run(name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    every = () if name == "none" else (f"train.checkpoint_every_steps={args.every}",)
    cmd = [
        sys.executable, "-m", "launcher", f"cluster.procs_per_node={args.ranks}", "train.threads_per_rank=1",
        "model=mlp", f"model.hidden={args.hidden}", "model.depth=6", "data=synthetic", "train.batch_size=64",
        f"train.max_steps={args.steps}", f"train.log_every_steps={args.every}", "train.plots=false",
        f"comm.reducer={args.reducer}", "train.keep_checkpoints=2", *every, *VARIANTS[name], f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if r["kind"] == "train"][1:]  # after the first (start-up)
    saves = [r["blocked_ms"] for r in records if r["kind"] == "checkpoint" and r["step"] < args.steps]
    return {
        "step_ms": 1000 * statistics.mean(r["step_s"] for r in windows),
        "blocked_ms": statistics.median(saves) if saves else None,
        "saves": len(saves),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reducer", default="ddp", help="comm.reducer: ddp (one .pt by rank 0) or fsdp (DCP shards)")
    parser.add_argument("--ranks", type=int, default=2, help="local ranks (1: in the launcher's own process)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    found = {}
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        for name in ("none", "sync", "async"):
            found[name] = run(name, args, Path(tmp) / name)
            print(f"# {name}: {found[name]}", flush=True)
    result = {
        "blocked_ms": {k: found[k]["blocked_ms"] for k in ("sync", "async")},
        "step_ms": {k: found[k]["step_ms"] for k in VARIANTS},
        "reducer": args.reducer,
        "machine": machine(),
    }
    blocked, steps = result["blocked_ms"], result["step_ms"]
    shape = f"MLP hidden {args.hidden} x 6, {args.steps} steps, a save every {args.every}"
    print(f"# comm.reducer={args.reducer}, {args.ranks} local ranks, {shape}")
    rows = [
        ("blocked per save: async / sync", blocked["async"] / blocked["sync"], "<= 0.3"),
        ("mean step: async / sync", steps["async"] / steps["sync"], "<= 1.05"),
        ("mean step: sync / none", steps["sync"] / steps["none"], ""),
        ("mean step: async / none", steps["async"] / steps["none"], ""),
    ]
    print(table(["ratio", "measured", "goal"], [(n, f"{v:.3f}", g) for n, v, g in rows]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
