"""End to end, as a user runs it: ``python -m launcher`` (elastic agent, real gloo ranks) and torchrun: the jobs
compared with one uninterrupted run (the module's ``uninterrupted``): a failure, a corrupted checkpoint, a restart, a
stop under torchrun, each resumed bit-identically. The other end-to-end jobs: test_launch_more.py (its own xdist group:
the suite's time)."""

import json
import re
import shlex
import subprocess
import sys

import pytest

from harness import REPO
from harness.checks import assert_same_training_state, assert_trained_once_up_to, final_state
from harness.run import run_launcher, user_env

SHORT = ("train.max_steps=30", "train.checkpoint_every_steps=10", "train.log_every_steps=5")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_launcher(*SHORT, run_dir=run_dir)
    assert result.returncode == 0, result.stderr
    return run_dir


def test_failing_rank_is_named_and_resume_is_bit_identical(tmp_path, uninterrupted):
    """One failure chain: rank 1 raises at step 25 (the report names it, its error and log; the checkpoints up to
    step 20 intact); the newest checkpoint then has one flipped byte: the resume skips it with a warning, goes on
    from step 10's and ends bit-identical to the uninterrupted run."""
    failed = run_launcher(*SHORT, run_dir=tmp_path, env={"LAUNCHER_FAULT": "step=25,rank=1"})
    assert failed.returncode == 1
    assert re.search(r"launcher: rank 1 \(pid \d+\) on \S+ failed:\nTraceback", failed.stderr), failed.stderr
    assert "Traceback" in failed.stderr and "RuntimeError: injected fault at step 25 on rank 1" in failed.stderr
    assert f"log of rank 1: {tmp_path}/logs/rank-1.log" in failed.stderr
    assert final_state(tmp_path)["step"] == 20  # the last good checkpoint is intact

    newest = tmp_path / "checkpoints" / "step-00000020.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the tensors
    newest.write_bytes(bytes(data))
    resumed = run_launcher(*SHORT, run_dir=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    said = f"skipping checkpoint {newest}: checkpoint {newest} is corrupted"
    assert said in (tmp_path / "logs" / "rank-0.log").read_text(), "the corrupted newest checkpoint not skipped"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000010.pt") and summary["steps"] == 30, summary
    assert_trained_once_up_to(tmp_path, 10)
    assert_same_training_state(final_state(tmp_path), final_state(uninterrupted))


def test_torchrun_entry_stops_prints_its_command_and_resumes_with_it(tmp_path, uninterrupted):
    """Under torchrun: SIGTERM to torchrun (rank 0 sends it at step 15) stops the ranks at one step with a checkpoint;
    rank 0 prints the torchrun command that continues the run (issue 36: the run dir was a random id, no rerun found
    it), which resumes from the run dir's own overrides and ends as the launcher's own agent does, with the summary."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    # --log-dir: torchrun's default is a new torchelastic_* directory in the temp dir, left behind
    module = (*torchrun, f"--log-dir={tmp_path}/torchrun", "-m", "launcher")
    fault = {"LAUNCHER_FAULT": "step=15,signal=TERM,target=parent"}
    stopped = run_launcher(*SHORT, run_dir=tmp_path, module=module, env=fault)
    assert stopped.returncode != 0, stopped.stderr
    step = final_state(tmp_path)["step"]
    assert 15 <= step < 30, stopped.stderr[-3000:]
    assert f"launcher: stopped by SIGTERM; the newest checkpoint is {tmp_path}/checkpoints/step-{step:08d}.pt" in (
        stopped.stderr
    )
    command = re.search(r"launcher: the command: (.*)", stopped.stderr)
    assert command, stopped.stderr[-3000:]
    argv = shlex.split(command.group(1).replace(f"--log-dir={tmp_path}/torchrun", f"--log-dir={tmp_path}/again"))
    assert argv[0] == sys.executable and argv[-3:] == ["-m", "launcher", f"hydra.run.dir={tmp_path}"], argv
    resumed = subprocess.run(argv, cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "[launcher] done: 30 steps" in resumed.stderr, resumed.stderr[-3000:]  # the summary, from rank 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["world_size"], summary["procs_per_node"]) == (2, 2)
    assert summary["resumed_from"].endswith(f"step-{step:08d}.pt")
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "logs" / "rank-1.log").is_file()
    # one worker per rank, started by torchrun: same result as the launcher's own agent
    assert_trained_once_up_to(tmp_path, step)
    assert_same_training_state(final_state(tmp_path), final_state(uninterrupted))


def test_killed_rank_with_restarts_resumes(tmp_path, uninterrupted):
    """``cluster.max_restarts=1``: rank 1 SIGKILLed at step 15 of the first attempt; the restart is announced once,
    naming the rank and its signal; the group resumes from step 10's checkpoint and ends bit-identical to the
    uninterrupted run (a rank's error instead of a signal: test_launch_more.py's one-rank restart, and over ssh
    tests/beds/test_ssh.py::test_max_restarts_restarts_every_machine_from_the_checkpoint)."""
    result = run_launcher(
        *SHORT,
        "cluster.max_restarts=1",
        run_dir=tmp_path,
        env={"LAUNCHER_FAULT": "step=15,rank=1,signal=KILL,attempt=0"},
    )
    assert result.returncode == 0, result.stderr
    said = r"^launcher: attempt 0 ended: rank 1 \(pid \d+\) on \S+ died with signal 9 \(SIGKILL\); restarting: "
    said += r"attempt 1 starts \(restart 1 of 1, 0 left"
    assert len(re.findall(said, result.stderr, re.M)) == 1, result.stderr[-3000:]  # announced once, with its cause
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000010.pt")
    cause = summary["attempts"][0]["cause"]  # the killed rank, not the peer that saw its connection close
    assert (cause["rank"], cause["signal"], cause["kind"]) == (1, "SIGKILL", "died"), summary["attempts"]
    assert [a["ended"] for a in summary["attempts"]] == ["failed", "finished"]
    assert_trained_once_up_to(tmp_path, 10)
    assert_same_training_state(final_state(tmp_path), final_state(uninterrupted))
