"""Launch time against torchrun (issue 60, sharp edge 9): the same 2-rank ``script=`` job that only meets at a
barrier, started as a whole process by ``python -m launcher`` and by ``torchrun --standalone``, in pairs (the two
one after the other, alternating which goes first, so a machine's drift touches both alike). Prints each side's
median wall time and CPU (user + system of the process and everything it waited for), their ratios (torchrun the
anchor), and where the difference goes: the head's imports (``import launcher.commands.cli`` against ``import
torch.distributed.run``, each timed alone the same number of times) and the rest (Hydra's compose, the plan, the
store and secret, the rank entry, the end of job's summary).

    python bench/launch.py [--pairs 7] [--ranks 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARRIER = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""
REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of it and the processes it waited for) of ``argv`` run to its end; it must
    succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(pairs: int, ranks: int, work: Path) -> dict:
    script = work / "barrier.py"
    script.write_text(BARRIER)
    env_python = sys.executable
    sides: dict[str, list[tuple[float, float]]] = {"launcher": [], "torchrun": [], "import_launcher": []}
    sides["import_torchrun"] = []
    for i in range(pairs):
        launcher = [env_python, "-m", "launcher", f"script={script}", f"cluster.procs_per_node={ranks}"]
        launcher.append(f"hydra.run.dir={work / f'run-{i}'}")
        torchrun = [env_python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        torchrun += [f"--log-dir={work / f'torchrun-{i}'}", str(script)]
        order = [("launcher", launcher), ("torchrun", torchrun)]
        for name, argv in order if i % 2 == 0 else order[::-1]:
            sides[name].append(timed(argv, REPO))
        sides["import_launcher"].append(timed([env_python, "-c", "import launcher.commands.cli"], REPO))
        sides["import_torchrun"].append(timed([env_python, "-c", "import torch.distributed.run"], REPO))
    median = {
        name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        for name, runs in sides.items()
    }
    (launcher_s, launcher_cpu), (torchrun_s, torchrun_cpu) = median["launcher"], median["torchrun"]
    imports_s = median["import_launcher"][0] - median["import_torchrun"][0]
    return {
        "pairs": pairs,
        "ranks": ranks,
        "launcher_s": round(launcher_s, 3),
        "torchrun_s": round(torchrun_s, 3),
        "ratio": round(launcher_s / torchrun_s, 3),
        "launcher_cpu_s": round(launcher_cpu, 3),
        "torchrun_cpu_s": round(torchrun_cpu, 3),
        "cpu_ratio": round(launcher_cpu / torchrun_cpu, 3),
        "head_imports_extra_s": round(imports_s, 3),
        "rest_extra_s": round(launcher_s - torchrun_s - imports_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=7, help="paired runs (the medians are reported)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the job (one machine)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.pairs < 1 or args.ranks < 1:
        parser.error(f"--pairs={args.pairs} and --ranks={args.ranks} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as work:
        figures = measure(args.pairs, args.ranks, Path(work))
    print(
        f"a {args.ranks}-rank script job that meets at a barrier, median of {args.pairs} pairs:\n"
        f"  launcher {figures['launcher_s']:.2f} s wall, {figures['launcher_cpu_s']:.2f} CPU-s\n"
        f"  torchrun {figures['torchrun_s']:.2f} s wall, {figures['torchrun_cpu_s']:.2f} CPU-s (the anchor)\n"
        f"  ratio {figures['ratio']:.2f}x wall, {figures['cpu_ratio']:.2f}x CPU\n"
        f"  where the difference goes: the head's imports {figures['head_imports_extra_s']:+.2f} s, "
        f"the rest {figures['rest_extra_s']:+.2f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
