"""bench/your_loop.py's job rows: the built-in trainer and the loop through ``launcher.Engine`` (bench/engine_job.py),
each a ``python -m launcher +cluster=sim cluster.netns=true cluster.link_gbit=...`` job on the same settings
(``comm.reducer=ddp``, ``comm.hierarchical=auto``, ``comm.compress=...`` after 5 uncompressed steps, the same model,
data, global batch and fused SGD), each timed the trainer's way (the median samples/s of the 5-step windows after
step 15, rank 0's wall time), run one after the other in pairs (trainer, engine) per setting: the same measurement in
the same kind of processes, so their ratio is the engine's cost against the trainer's loop."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPRESSES = ("none", "bf16", "powersgd")


def engine_job(compress: str, args: argparse.Namespace, run_dir: Path) -> dict:
    out = run_dir / "engine.json"
    cmd = [
        sys.executable, "-m", "launcher", "+cluster=sim", "cluster.netns=true", f"cluster.link_gbit={args.link_gbit}",
        "cluster.procs_per_node=2", "comm.reducer=ddp", "comm.hierarchical=auto", f"comm.compress={compress}",
        "comm.compress_warmup_steps=5", "script=bench/engine_job.py", "train.plots=false", f"hydra.run.dir={run_dir}",
        "--", str(out), f"--steps={args.trainer_steps}",
    ]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    done = json.loads(out.read_text())
    windows = [w["samples_per_s"] for w in done["windows"] if w["step"] > 15]
    sps = statistics.median(windows)
    return {"samples_per_s": sps, "step_ms": 128 / sps * 1e3, "sync": done["sync"]}


def job_rows(args: argparse.Namespace) -> dict[str, dict]:
    """``trainer-<compress>`` and ``engine-job-<compress>`` for each compress, in pairs."""
    from end_to_end import run

    settings = argparse.Namespace(link_gbit=args.link_gbit, steps=args.trainer_steps, compression=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, compress in enumerate(COMPRESSES):
            trainer = rows[f"trainer-{compress}"] = run(
                "ddp", "auto", "backward", compress, settings, Path(tmp) / f"t{i}"
            )
            engine = rows[f"engine-job-{compress}"] = engine_job(compress, args, Path(tmp) / f"e{i}")
            print(
                f"# comm.compress={compress}: trainer {trainer['samples_per_s']:.0f}, engine job "
                f"{engine['samples_per_s']:.0f} samples/s",
                flush=True,
            )
    return rows
