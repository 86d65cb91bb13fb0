"""The line a job stopped by SIGTERM / Ctrl-C ends with (``nodes.control.stop_message``) says only what the launcher
knows: nothing about a checkpoint for a ``script=`` job (the launcher writes none for it); for the built-in trainer,
the newest checkpoint in the run dir by name, or that there is none yet. (A real script job stopped by SIGTERM:
tests/harness/stops.py: the signal matrix.)"""

from pathlib import Path

import pytest

from harness.config import plan
from launcher.base.run_dir import RunDir
from launcher.report.stops import print_stopped, stop_message

NO_CLAIM = ("wrote a checkpoint", "to continue", "checkpoint is")


def write_checkpoints(run_dir: Path, *steps: int) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    for step in steps:
        (run_dir / "checkpoints" / f"step-{step:08d}.pt").write_bytes(b"")
    (run_dir / "checkpoints" / "step-00000099.pt.tmp").write_bytes(b"")  # a save in progress is no checkpoint


@pytest.mark.parametrize("code, name", [(143, "SIGTERM"), (130, "SIGINT")])
def test_script_job_makes_no_checkpoint_claim(tmp_path, code, name):
    write_checkpoints(tmp_path, 20)  # even a file of that name is not the launcher's to vouch for
    line = stop_message(code, RunDir(tmp_path), script=True)
    assert line == (
        f"launcher: stopped by {name}; the script's ranks were stopped (the launcher writes no checkpoint for a "
        "script=: whether it saved anything is up to the script)"
    )
    assert not any(claim in line for claim in NO_CLAIM)


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
    print_stopped(143, plan("script=tests/scripts/allreduce_script.py", run_dir=tmp_path)[0])
    assert "the script's ranks were stopped" in capsys.readouterr().err
