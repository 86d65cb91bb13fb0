"""Root cause first, every time: a job whose rank fails names that rank and shows its own error, never a peer
that failed a moment later in a collective, with one report for the whole job, within 10 s of the failure.

Each case runs once in the suite; ``LAUNCHER_STRESS=N`` repeats each N times (run before submitting a change
to the failure path: ``LAUNCHER_STRESS=4 ./scripts/test.sh tests/jobs/test_root_cause.py`` is 24 runs per mode).
Slurm's cases live in tests/beds/test_slurm.py (they need its cluster fixture), ssh's in tests/beds/test_ssh.py;
the jobs (``job_args``), the runner that enforces the report's bound while the job runs (``run_watched``) and the
check (``expect_root_cause``) are in the harness (harness.jobs, harness.run, harness.checks)."""

import io
import re
import time

import pytest

from harness.checks import expect_root_cause
from harness.jobs import REPEAT, job_args
from harness.run import run_watched
from launcher.launch.ports import free_port, port_in_use

CASES = [(kind, where) for kind in ("script", "trainer") for where in ("before", "between", "inside")]


@pytest.mark.parametrize("repeat", range(REPEAT))
@pytest.mark.parametrize("kind,where", CASES)
def test_local_names_the_failing_rank(tmp_path, kind, where, repeat):
    args, env = job_args(kind, where, rank=1)
    port = free_port("127.0.0.1")  # fixed, to check that the failure released it
    code, stderr, at = run_watched([*args, f"cluster.master_port={port}"], tmp_path, env)
    expect_root_cause(code, stderr, at, tmp_path, 1, kind, where)
    assert port_in_use("127.0.0.1", port) is None, f"the rendezvous port {port} is still taken after the failure"


# across nodes: one case (every kind and moment runs locally above; the kind and the moment change only the rank's
# side, and the node agents' relay and the head's choice are the same for every case: the suite's time)
SIM_CASES = [("trainer", "inside")]


@pytest.mark.parametrize("repeat", range(REPEAT))
@pytest.mark.parametrize("kind,where", SIM_CASES)
def test_sim_names_the_failing_rank_across_nodes(tmp_path, kind, where, repeat):
    """2 virtual nodes x 2 ranks; the failing rank alternates between node 0 (rank 1) and node 1 (rank 2) from one
    repeat to the next (``LAUNCHER_STRESS``)."""
    rank = 1 if (repeat + SIM_CASES.index((kind, where))) % 2 == 0 else 2
    args, env = job_args(kind, where, rank)
    code, stderr, at = run_watched(
        ["+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2", *args], tmp_path, env
    )
    expect_root_cause(code, stderr, at, tmp_path, rank, kind, where)
    assert re.search(rf"^launcher: rank {rank} \(node {rank // 2}, pid \d+\)", stderr, re.M), stderr[-2000:]
    assert len(re.findall(r"^launcher: failed too: rank", stderr, re.M)) >= 1


def test_the_report_ranks_by_kind_not_by_the_clock(tmp_path):
    """On one host the cause always records first, so ranking by time alone would pass every case above. Here
    the others record first (a peer noticing before the cause's record lands, or machines whose clocks
    disagree): a peer's "connection closed", a rank the launcher stopped and one killed by a signal are all older
    than the cause's own error, and the report still leads with the cause, then death, peer, stopped."""
    from launcher.base.env import DistEnv
    from launcher.base.run_dir import RunDir
    from launcher.report import failures

    def log(rank: int) -> failures.FailureLog:
        env = DistEnv(
            rank=rank, world_size=4, node_rank=rank // 2, num_nodes=2, hostname=f"m{rank // 2}", launch_id="j"
        )
        return failures.FailureLog(RunDir(tmp_path), env)

    log(0).record(RuntimeError("Connection closed by peer [10.0.0.2]:4242"))
    log(3).record(KeyboardInterrupt())
    directory = RunDir(tmp_path).failure_attempt("j", 0)
    failures.record_exits(directory, [failures.exit_failure(2, 99, -9, "m1", node=1, nodes=2)])
    time.sleep(0.01)  # the cause's record is the newest by a clear margin
    log(1).record(RuntimeError("the cause"))
    records = {f.rank: f for f in failures.load_newest(RunDir(tmp_path), "j")}
    assert [records[r].kind for r in range(4)] == ["peer", "error", "died", "stopped"], records
    assert records[1].time_ns > max(records[r].time_ns for r in (0, 2, 3))
    out = io.StringIO()
    assert failures.print_report(RunDir(tmp_path), "j", file=out)
    heads = re.findall(r"^launcher: (?:failed too: )?rank (\d)", out.getvalue(), re.M)
    assert heads == ["1", "2", "0", "3"], out.getvalue()
    assert out.getvalue().startswith("launcher: rank 1 (node 0, pid "), out.getvalue()


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    """A rank that died of a signal and wrote no record (its agent records its exit code, -9) leads the report,
    named with its signal, before a peer the launcher stopped. (The agent's record of a real SIGKILL, and the
    restart line that names it: tests/jobs/test_launch.py::test_killed_rank_with_restarts_resumes.)"""
    from launcher.base.run_dir import RunDir
    from launcher.report import failures

    run_dir = RunDir(tmp_path)
    directory = run_dir.failure_attempt("j", 0)
    failures.record_exits(
        directory, [failures.exit_failure(0, 41, -15, "box"), failures.exit_failure(1, 42, -9, "box")]
    )
    out = io.StringIO()
    assert failures.print_report(run_dir, "j", file=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "launcher: rank 1 (pid 42) on box died with signal 9 (SIGKILL)", out.getvalue()
    assert lines[1] == f"launcher: log of rank 1: {run_dir.rank_log(1)}", out.getvalue()
    assert "launcher: failed too: rank 0 on box, stopped by the launcher" in lines[2], out.getvalue()
