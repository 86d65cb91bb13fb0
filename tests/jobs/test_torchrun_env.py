"""Issue 47 (item 6): a ``script=`` job sees every variable torchrun gives a worker, with torchrun's meaning, in every
mode: one script (tests/scripts/print_torchrun_env.py) writes each rank's variables, run by torchrun itself and by
the launcher on the same layout (2 ranks on one node: ``python -m launcher``; 2 nodes of one rank:
``+cluster=sim`` against two torchrun agents meeting at one rendezvous), the same ``max_restarts``. Compared: the
same names; the same values where they must match (ranks, sizes, role, restart count and limit, the agent store);
the same meaning for the rest (one run id on every rank, one master address and port, OMP_NUM_THREADS the threads
the rank really runs: torchrun's 1, our cores / ranks; docs/running.md). The paths without an agent (Slurm tasks, a
job that heals in place) are held to the same table in tests/rules/test_torchrun_environ.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REPO, path_override
from harness.run import run_launcher, user_env
from launcher.launch.ports import free_port

SCRIPT = REPO / "tests" / "scripts" / "print_torchrun_env.py"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
MAX_RESTARTS = 1  # the same limit under both: TORCHELASTIC_MAX_RESTARTS must say it
THREADS = "OMP_NUM_THREADS"
# where a rank's error record goes for the agent that started it (a script's @record writes it): none without one
AGENT_ONLY = {"TORCHELASTIC_ERROR_FILE"}
# which signals the agent forwards to its workers: its own setting (elastic_launch exports it, workers inherit it),
# nothing a worker reads
AGENTS_SETTING = {"TORCHELASTIC_SIGNALS_TO_HANDLE"}
DEADLINE_S = 120  # torchrun's run (a few seconds): a hang fails the test, its processes killed
# what must be equal, rank by rank, under torchrun and the launcher on the same layout
SAME = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def run_torchrun(out: Path, logs: Path, *nodes: list[str], restarts: int) -> None:
    """torchrun as a user runs it, one agent per entry of ``nodes`` (its flags), all at once, each in its own session
    with its console in ``logs``; every agent must exit 0 within ``DEADLINE_S``, else all are killed and the test
    fails."""
    agents = []
    try:
        for node, flags in enumerate(nodes):
            console = open(logs / f"torchrun-{node}.log", "w")  # noqa: SIM115 - closed with its agent below
            argv = [*TORCHRUN, f"--log-dir={logs}/elastic-{node}", f"--max-restarts={restarts}", *flags]
            agents.append(
                (
                    subprocess.Popen(
                        [*argv, str(SCRIPT), str(out)],
                        cwd=REPO,
                        env=user_env(),
                        stdout=console,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    ),
                    console,
                )
            )
        deadline = time.monotonic() + DEADLINE_S
        for proc, _ in agents:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for proc, console in agents:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            console.close()
    consoles = "\n".join(p.read_text()[-2000:] for p in sorted(logs.glob("torchrun-*.log")))
    assert all(proc.returncode == 0 for proc, _ in agents), consoles


def records(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def under_torchrun(tmp_path: Path, *nodes: list[str], world: int, restarts: int = MAX_RESTARTS) -> list[dict]:
    out, logs = tmp_path / "torchrun-out", tmp_path / "torchrun"
    out.mkdir()
    logs.mkdir()
    run_torchrun(out, logs, *nodes, restarts=restarts)
    return records(out, world)


def under_launcher(tmp_path: Path, *overrides: str, world: int, restarts: int = MAX_RESTARTS) -> list[dict]:
    out = tmp_path / "launcher-out"
    out.mkdir()
    run = run_launcher(
        path_override("script", SCRIPT),
        f"cluster.max_restarts={restarts}",
        *overrides,
        "--",
        str(out),
        run_dir=tmp_path / "run",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return records(out, world)


def assert_same_meaning(theirs: list[dict], ours: list[dict], agent: bool = True) -> None:
    """Ours (the launcher's ranks) against theirs (torchrun's), rank by rank, on the same layout; ``agent``: an
    elastic agent started ours too (its own machinery's variables: ``AGENT_ONLY``)."""
    for torchrun_rank, our_rank in zip(theirs, ours, strict=True):
        t, o = torchrun_rank["env"], our_rank["env"]
        # OMP_NUM_THREADS: ours always (the threads we chose), torchrun's only with several ranks per node (its 1)
        names = (set(t) if agent else set(t) - AGENT_ONLY) - AGENTS_SETTING | {THREADS}
        given = set(o) - AGENTS_SETTING
        assert given == names, f"names: missing {sorted(names - given)}, extra {sorted(given - names)}"
        assert {k: o[k] for k in SAME} == {k: t[k] for k in SAME}
        assert o[THREADS] == str(our_rank["threads"]), our_rank  # the threads the rank really runs
        assert t.get(THREADS, str(torchrun_rank["threads"])) == str(torchrun_rank["threads"]), torchrun_rank
        assert our_rank["allreduce"] == torchrun_rank["allreduce"] == len(theirs)  # the variables work
    for ranks in (theirs, ours):
        for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):  # one per job, the same on every rank
            values = {r["env"][name] for r in ranks}
            assert len(values) == 1 and "" not in values, (name, values)
        port = int(ranks[0]["env"]["MASTER_PORT"])
        assert 0 < port < 2**16
        # rank 0's machine, this one: torchrun names it (localhost, or its host name), the launcher its address
        assert of_this_machine(ranks[0]["env"]["MASTER_ADDR"]), ranks[0]["env"]["MASTER_ADDR"]


def of_this_machine(addr: str) -> bool:
    """``addr`` (a name or an address) is one of this machine's: a socket binds to it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((socket.gethostbyname(addr), 0))
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_two_ranks_on_one_node_see_what_torchrun_gives(tmp_path):
    theirs = under_torchrun(tmp_path, ["--standalone", "--nproc_per_node=2"], world=2)
    ours = under_launcher(tmp_path, "cluster.procs_per_node=2", world=2)
    assert_same_meaning(theirs, ours)
    assert [r["env"]["LOCAL_RANK"] for r in ours] == ["0", "1"]  # (the comparison's anchors, as torchrun gives them)
    assert {r["env"]["TORCHELASTIC_MAX_RESTARTS"] for r in ours} == {str(MAX_RESTARTS)}
    assert {r["env"]["ROLE_NAME"] for r in ours} == {"default"}


@pytest.mark.slow
def test_two_simulated_nodes_see_what_two_torchrun_agents_give(tmp_path):
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    common = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
    common.append("--rdzv-id=torchrun-env")
    theirs = under_torchrun(tmp_path, [*common, "--rdzv-conf=is_host=1"], [*common, "--rdzv-conf=is_host=0"], world=2)
    ours = under_launcher(tmp_path, "+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1", world=2)
    assert_same_meaning(theirs, ours)
    assert [(r["env"]["GROUP_RANK"], r["env"]["GROUP_WORLD_SIZE"]) for r in ours] == [("0", "2"), ("1", "2")]


@pytest.mark.slow
def test_one_process_without_an_agent_sees_what_torchrun_gives_one_worker(tmp_path):
    """One rank: the launcher runs it in its own process, no agent (as a Slurm task's rank: no agent either), and
    nothing restarts it."""
    theirs = under_torchrun(tmp_path, ["--standalone", "--nproc_per_node=1"], world=1, restarts=0)
    ours = under_launcher(tmp_path, "cluster.procs_per_node=1", world=1, restarts=0)
    assert_same_meaning(theirs, ours, agent=False)
    assert ours[0]["env"]["TORCHELASTIC_RUN_ID"] != "none"  # one of its own, as torchrun --standalone gives one
