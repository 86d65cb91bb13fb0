"""Root cause first, every time: a job whose rank fails names that rank and shows its own error, never a peer
that failed a moment later in a collective, with one report for the whole job, within 10 s of the failure.

Each case runs once in the suite; ``LAUNCHER_STRESS=N`` repeats each N times (run before submitting a change
to the failure path: ``LAUNCHER_STRESS=4 ./scripts/test.sh tests/test_root_cause.py`` is 24 runs per mode).
Slurm's cases live in test_slurm.py (they need its cluster fixture) and use ``expect_root_cause`` from here."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO
from launcher.launch.ports import free_port, port_in_use

REPEAT = int(os.environ.get("LAUNCHER_STRESS", "1"))
SCRIPT = REPO / "tests" / "scripts" / "fail_script.py"
TRAIN = ("train.max_steps=8", "train.checkpoint_every_steps=0", "train.log_every_steps=4")
# trainer faults: before the first collective (before joining), between collectives, inside one (backward)
FAULTS = {"before": "step=0", "between": "step=3", "inside": "step=3,backward"}
MESSAGES = {
    "before": {
        "script": "boom before the first collective on rank {r}",
        "trainer": "injected fault at step 0 on rank {r}",
    },
    "between": {"script": "boom between collectives on rank {r}", "trainer": "injected fault at step 3 on rank {r}"},
    "inside": {"script": "boom inside a collective on rank {r}", "trainer": "injected fault at step 3 on rank {r}"},
}
REPORT_S = 10.0


def job_args(kind: str, where: str, rank: int) -> tuple[list[str], dict[str, str]]:
    if kind == "script":
        return [f"script={SCRIPT}", f"script_args=[{where},{rank}]"], {}
    return list(TRAIN), {"LAUNCHER_FAULT": f"{FAULTS[where]},rank={rank}"}


def run_watched(args: list[str], run_dir: Path, env: dict[str, str], timeout: float = 240) -> tuple[int, str, float]:
    """Run ``python -m launcher`` and note when (wall clock) its failure report began on stderr."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCHER_", "TORCHELASTIC_"))}
    full_env.update(env)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", f"hydra.run.dir={run_dir}", *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines, reported_at = [], 0.0
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stderr:
            if not reported_at and re.match(r"launcher: rank \d+ \(", line):
                reported_at = time.time()
            lines.append(line)
            if time.monotonic() > deadline:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, "".join(lines), reported_at


def expect_root_cause(code: int, stderr: str, reported_at: float, run_dir: Path, rank: int, message: str) -> None:
    """The job failed, the report names ``rank`` first with its own error, once, within REPORT_S of its record."""
    assert code == 1, stderr[-3000:]
    heads = re.findall(r"^launcher: rank (\d+) \(.*$", stderr, re.M)
    assert heads[:1] == [str(rank)], f"expected rank {rank} named first:\n{stderr[-3000:]}"
    assert len(heads) == 1, f"more than one report:\n{stderr[-3000:]}"
    report = stderr[stderr.index("launcher: rank ") :]
    assert message in report, f"rank {rank}'s own error missing from the report:\n{report}"
    assert f"log of rank {rank}: {run_dir}/logs/rank-{rank}.log" in report
    assert "Connection closed by peer" not in report.split("launcher: log of rank")[0]  # peers come after
    record = json.loads(next(run_dir.glob(f"failures/*/attempt-*/rank-{rank}.json")).read_text())
    assert record["kind"] == "error", record
    delay = reported_at - record["time_ns"] / 1e9
    assert 0 <= delay < REPORT_S, f"report {delay:.1f} s after the failure"


CASES = [(kind, where) for kind in ("script", "trainer") for where in ("before", "between", "inside")]


@pytest.mark.parametrize("repeat", range(REPEAT))
@pytest.mark.parametrize("kind,where", CASES)
def test_local_names_the_failing_rank(tmp_path, kind, where, repeat):
    args, env = job_args(kind, where, rank=1)
    port = free_port("127.0.0.1")  # fixed, to check that the failure released it
    code, stderr, at = run_watched([*args, f"cluster.master_port={port}"], tmp_path, env)
    expect_root_cause(code, stderr, at, tmp_path, 1, MESSAGES[where][kind].format(r=1))
    assert port_in_use("127.0.0.1", port) is None, f"the rendezvous port {port} is still taken after the failure"


@pytest.mark.parametrize("repeat", range(REPEAT))
@pytest.mark.parametrize("kind,where", CASES)
def test_sim_names_the_failing_rank_across_nodes(tmp_path, kind, where, repeat):
    """2 virtual nodes x 2 ranks; the failing rank alternates between node 0 (rank 1) and node 1 (rank 2)."""
    rank = 1 if (repeat + CASES.index((kind, where))) % 2 == 0 else 2
    args, env = job_args(kind, where, rank)
    code, stderr, at = run_watched(
        ["+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2", *args], tmp_path, env
    )
    expect_root_cause(code, stderr, at, tmp_path, rank, MESSAGES[where][kind].format(r=rank))
    assert re.search(rf"^launcher: rank {rank} \(node {rank // 2}, pid \d+\)", stderr, re.M), stderr[-2000:]
    assert len(re.findall(r"^launcher: failed too: rank", stderr, re.M)) >= 1
