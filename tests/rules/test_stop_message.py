"""The line a job stopped by SIGTERM / Ctrl-C ends with (``report.stops.stop_message``) says only what the launcher
knows: for a ``script=`` job how each rank ended after it got the signal (as recorded in the run dir: its agent's
records, a rank's own) and nothing about a checkpoint (the launcher writes none for it); for the built-in trainer,
the newest checkpoint in the run dir by name, or that there is none yet. The line an agent says when it kills ranks
at the end of their grace (``said_killed``), and a second stop signal passed on by its own name. (Real jobs stopped
by each signal: tests/harness/stops.py, the signal matrix; killed after their grace: tests/jobs/test_stop_grace.py.)"""

import signal
from pathlib import Path

import pytest

from harness.config import plan
from launcher.base.run_dir import RunDir
from launcher.launch.nodes.control import Control, abort, forwarding_stops
from launcher.report.stops import RankEnd, load_ends, print_stopped, record_ends, said_killed, stop_message

NO_CLAIM = ("wrote a checkpoint", "to continue", "checkpoint is")


def write_checkpoints(run_dir: Path, *steps: int) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    for step in steps:
        (run_dir / "checkpoints" / f"step-{step:08d}.pt").write_bytes(b"")
    (run_dir / "checkpoints" / "step-00000099.pt.tmp").write_bytes(b"")  # a save in progress is no checkpoint


@pytest.mark.parametrize("code, name", [(143, "SIGTERM"), (130, "SIGINT"), (129, "SIGHUP")])
def test_script_job_says_how_each_rank_ended_and_makes_no_checkpoint_claim(tmp_path, code, name):
    write_checkpoints(tmp_path, 20)  # even a file of that name is not the launcher's to vouch for
    ends = [
        RankEnd(2, "b", -15, node=1),
        RankEnd(0, "a", 0),
        RankEnd(1, "a", 0),
        RankEnd(3, "b", None, node=1, killed="after 2 s (cluster.stop_grace_s)"),
        RankEnd(4, "c", 130, node=2),
    ]
    line = stop_message(code, RunDir(tmp_path), script=True, ends=ends)
    assert line == (
        f"launcher: stopped by {name}; how the script's ranks ended: ranks 0, 1 on a exited 0; rank 2 on b ended by "
        "SIGTERM; rank 3 on b killed after 2 s (cluster.stop_grace_s); rank 4 on c exited 130 (the launcher writes "
        "no checkpoint for a script=: what it saves on a stop is its own handler's)"
    )
    assert not any(claim in line for claim in NO_CLAIM)
    nothing = stop_message(code, RunDir(tmp_path), script=True)
    assert (
        "how the script's ranks ended: none left word (a rank ended by the signal itself or killed leaves none)"
        in nothing
    )


def test_the_ranks_ends_are_read_from_the_newest_attempts_records(tmp_path):
    """An agent's record replaces the rank's own; a later attempt's records are the ones read."""
    run = RunDir(tmp_path)
    record_ends(run, "L", 0, [RankEnd(0, "a", 0), RankEnd(1, "a", 0), RankEnd(2, "a", 0)])
    record_ends(run, "L", 1, [RankEnd(1, "a", 0), RankEnd(0, "a", 0)])  # the rank's own
    record_ends(run, "L", 1, [RankEnd(1, "a", -9, killed="after 30 s (cluster.stop_grace_s)")])  # its agent's
    assert load_ends(run, "L") == [RankEnd(0, "a", 0), RankEnd(1, "a", -9, killed="after 30 s (cluster.stop_grace_s)")]
    assert load_ends(run, "other") == []


def test_the_kill_line_names_the_ranks_the_time_and_why():
    line, why = said_killed((0, 1), "box", 15, 2.0, None, 2.01)
    assert line == "launcher: ranks 0, 1 on box did not exit within 2 s of SIGTERM (cluster.stop_grace_s): killed"
    assert why == "after 2 s (cluster.stop_grace_s)"
    line, why = said_killed((3,), "box", 2, 30.0, 2, 4.25)
    assert line == "launcher: a second stop signal (SIGINT) 4.2 s into the ranks' grace: rank 3 on box killed at once"
    assert why == "at once (a second stop signal, SIGINT)"


def test_trainer_with_checkpoints_names_the_newest(tmp_path):
    write_checkpoints(tmp_path, 10, 20, 9)
    newest = tmp_path / "checkpoints" / "step-00000020.pt"
    assert stop_message(143, RunDir(tmp_path), script=False) == (
        f"launcher: stopped by SIGTERM; the newest checkpoint is {newest} (step 20): run again with "
        f"hydra.run.dir={tmp_path} to continue from it"
    )


@pytest.mark.parametrize("resume", ["never", "/old/step-00000050.pt"])
def test_trainer_that_would_not_resume_is_told_how(tmp_path, resume):
    write_checkpoints(tmp_path, 10)
    line = stop_message(130, RunDir(tmp_path), script=False, resume=resume)
    assert line.endswith(f"run again with hydra.run.dir={tmp_path} train.resume=auto to continue from it")


def test_trainer_without_checkpoint_says_so(tmp_path):
    assert stop_message(143, RunDir(tmp_path), script=False) == (
        f"launcher: stopped by SIGTERM; no checkpoint was written yet in {tmp_path / 'checkpoints'}: running again "
        "starts from the beginning"
    )
    (tmp_path / "checkpoints").mkdir()  # made at start-up, nothing saved in it yet
    assert "no checkpoint was written yet" in stop_message(143, RunDir(tmp_path), script=False)
    line = stop_message(143, RunDir(tmp_path), script=False, resume="/old/step-00000050.pt")
    assert line.endswith("running again starts from train.resume=/old/step-00000050.pt")


def test_print_stopped_reads_the_job(tmp_path, capsys):
    write_checkpoints(tmp_path, 30)
    print_stopped(143, plan(run_dir=tmp_path)[0])
    assert "the newest checkpoint is" in capsys.readouterr().err
    job = plan("script=tests/scripts/allreduce_script.py", run_dir=tmp_path)[0]
    record_ends(job.run, "L", 0, [RankEnd(1, "b", 0), RankEnd(0, "a", 0)])
    print_stopped(143, job, "L")
    assert "how the script's ranks ended: rank 0 on a exited 0; rank 1 on b exited 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("second", "words"),
    [(Control.stop_for, [Control.INT, Control.TERM]), (abort, [Control.INT, Control.ABORT])],
    ids=["several-node-heads", "slurm"],
)
def test_a_second_stop_signal_is_passed_on_by_its_own_name(capfd, second, words):
    """Issue 60, item 6 (edge 7): a second stop signal to a simulated or ssh head was passed on as ``ABORT``, which a
    simulated node gets as SIGTERM: its agent said its ranks were killed at once on "a second stop signal,
    SIGTERM" after two Ctrl-C's, while the head said SIGINT. The several-node heads pass on the second signal's own
    word (each node's agent names it: tests/jobs/test_stop_grace.py); Slurm's head still kills every task at once."""
    sent: list[Control] = []
    with forwarding_stops(sent.append, "on every node", "the ranks checkpoint", second) as got:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)  # (a third: nothing more to pass on)
    assert (got, sent) == ([signal.SIGINT, signal.SIGTERM, signal.SIGINT], words)
    assert "launcher: a second stop signal (SIGTERM): ending the job on every node at once" in capfd.readouterr().err
