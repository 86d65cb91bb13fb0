"""Issue 47: every attempt of a job is listed in summary.json (``launcher.report.attempts``), its cause chosen by the
root-cause rules from that attempt's records (a SIGKILLed rank, recorded by its agent, before the peer that saw
its connection close), for a script's job too; a restart is announced in one line."""

import json
import re

from launcher.base.env import DistEnv
from launcher.base.run_dir import RunDir
from launcher.report import attempts
from launcher.report.failures import Failure, exit_failure, record_exits
from launcher.report.summary import RunSummary


def started(run: RunDir, launch: str, attempt: int, nodes: int = 2) -> None:
    for node in range(nodes):
        env = DistEnv(rank=node, world_size=nodes, node_rank=node, num_nodes=nodes, hostname=f"host{node}",
                      launch_id=launch, attempt=attempt)  # fmt: skip
        attempts.mark_start(run, env)


def test_each_attempt_is_listed_with_the_rank_that_ended_it(tmp_path):
    run = RunDir(tmp_path)
    started(run, "L1", 0)
    peer = Failure(rank=0, kind="peer", summary="RuntimeError: Connection reset by peer", host="host0", node=0,
                   nodes=2, pid=11, time_ns=1)  # fmt: skip
    record_exits(run.failure_attempt("L1", 0), [peer, exit_failure(1, 12, -9, "host1", node=1, nodes=2)])
    started(run, "L2", 1)  # the head restarted the job: another launch
    listed = attempts.attempts(run, 0)
    assert [(a["launch"], a["attempt"], a["ended"]) for a in listed] == [("L1", 0, "failed"), ("L2", 1, "finished")]
    cause = listed[0]["cause"]
    assert (cause["rank"], cause["node"], cause["host"], cause["signal"], cause["exit_code"]) == (
        1,
        1,
        "host1",
        "SIGKILL",
        None,
    )
    assert listed[1]["cause"] is None and listed[1]["hosts"] == ["host0", "host1"]
    assert [a["attempt"] for a in attempts.attempts(run, 0, launch="L2")] == [1]  # torchrun: its own launch only


def test_a_scripts_job_gets_a_summary_and_the_end_lines_name_each_attempt(tmp_path):
    run = RunDir(tmp_path)
    started(run, "L", 0, nodes=1)
    record_exits(run.failure_attempt("L", 0), [exit_failure(0, 7, 1, "host0")])
    started(run, "L", 1, nodes=1)
    lines = attempts.end_of_job(run, "train.py --lr 0.1", (1, 2), 1, since=0.0)
    summary = json.loads(run.summary.read_text())
    assert (summary["entry"], summary["world_size"], summary["hosts"], summary["exit"]) == (
        "train.py --lr 0.1",
        2,
        ["host0"],
        1,
    )
    assert [a["ended"] for a in summary["attempts"]] == ["failed", "failed"]
    assert summary["attempts"][0]["cause"]["exit_code"] == 1
    assert len(lines) == 2 and lines[0].endswith("failed: rank 0 on host0 (exited with code 1)"), lines
    assert RunSummary.read(run) is None  # no training part: nothing for the trainer's table


def test_a_restart_is_announced_with_the_cause_and_the_restarts_left():
    killed = exit_failure(3, 4242, -9, "box", node=1, nodes=2)
    peer = Failure(rank=0, kind="peer", summary="RuntimeError: Connection closed by peer", nodes=2, time_ns=0)
    line = attempts.restart_line(0, attempts.cause_of([peer, killed]), 1, 2)
    assert line == (
        "launcher: attempt 0 ended: rank 3 (node 1, pid 4242) on box died with signal 9 (SIGKILL); restarting: "
        "attempt 1 starts (restart 1 of 3, 2 left: cluster.max_restarts)"
    )


def test_the_end_lines_name_the_node_and_every_script_job_ends_with_one(tmp_path):
    """Issue 60, item 6 (edge 10): the end-of-run attempt lines name the node, as the restart's live line does; a
    script's job, of one attempt too, ends with a line saying how it ended and where its run dir is."""
    run = RunDir(tmp_path / "two")
    started(run, "L", 0)
    record_exits(run.failure_attempt("L", 0), [exit_failure(1, 12, -9, "host1", node=1, nodes=2)])
    started(run, "L", 1)
    lines = attempts.end_of_job(run, "train.py --lr 0.1", (2, 1), 0, since=0.0, script=True)
    assert lines[0].endswith(", failed: rank 1 (node 1) on host1 (died with signal 9 (SIGKILL))"), lines
    assert re.fullmatch(
        rf"launcher: script train\.py --lr 0\.1: finished, exit code 0, 2 attempts in [\d.]+ s; run dir "
        rf"{re.escape(str(run))} \(logs/rank-<k>\.log, summary\.json\)",
        lines[2],
    ), lines
    one = RunDir(tmp_path / "one")
    started(one, "M", 0, nodes=1)
    lines = attempts.end_of_job(one, "train.py", (1, 2), 130, since=0.0, script=True)
    assert len(lines) == 1 and lines[0].startswith("launcher: script train.py: stopped, exit code 130, 1 attempt in")
    assert attempts.end_of_job(one, "train LeNet on digits", (1, 2), 0, since=0.0) == []  # the trainer: its table
