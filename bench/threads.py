"""The same 2-rank DDP script under ``python -m launcher script=`` and under ``torchrun`` (the anchor), in one run.

    python bench/threads.py [--steps 60] [--ranks 2] [--repeats 2]

Each run's rank 0 times its steps after a warm-up and writes the median ms/step; runs alternate (launcher, torchrun,
launcher, ...) so a machine's drift hits both. Prints the medians and the ratio launcher / torchrun: the launcher's
threads per rank (``launcher/base/threads.py``) must keep it near 1 (issue 36: 1.85x before).
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
SCRIPT = """
import json, os, statistics, sys, time
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
torch.manual_seed(0)
layers = [nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 28 * 28, 10)]
model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 1, 32, 32), torch.randint(0, 10, (32,))
steps, times = int(sys.argv[1]), []
for step in range(steps):
    start = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"ms": 1000 * statistics.median(times[steps // 4:]), "threads": torch.get_num_threads()}, f)
dist.destroy_process_group()
"""


def run(how: str, ranks: int, steps: int, work: Path, n: int) -> dict:
    out = work / f"{how}-{n}.json"
    script = work / "ddp_script.py"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # each launcher's own default
    if how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        cmd += [f"--log-dir={work / f'torchrun-logs-{n}'}"]  # not a torchelastic_* folder left in the temp dir
        cmd += [str(script), str(steps), str(out)]
    else:
        cmd = [sys.executable, "-m", "launcher", f"hydra.run.dir={work / f'run-{n}'}", f"script={script}"]
        cmd += [f"script_args=[{steps},{out}]", f"cluster.procs_per_node={ranks}"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{how} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        work = Path(tmp)
        (work / "ddp_script.py").write_text(SCRIPT)
        seen: dict[str, list[dict]] = {"launcher": [], "torchrun": []}
        for n in range(args.repeats):
            for how in seen:
                seen[how].append(run(how, args.ranks, args.steps, work, n))
    ms = {how: statistics.median(r["ms"] for r in runs) for how, runs in seen.items()}
    rows = [[how, ms[how], runs[0]["threads"], ms[how] / ms["torchrun"]] for how, runs in seen.items()]
    print(f"{args.ranks} ranks, {args.steps} steps, {args.repeats} run(s) each; {machine()}")
    print(table(["started by", "ms/step (median)", "threads per rank", "ratio to torchrun"], rows))


if __name__ == "__main__":
    main()
