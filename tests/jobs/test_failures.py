"""Failures that must end with a named cause, released processes and ports, and no lost checkpoint:
ranks that never join, an unreachable master, a rank stuck mid-training, a full or read-only disk."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from harness import REPO
from harness.config import plan
from harness.run import run_launcher
from launcher.config import freeze
from launcher.launch.ports import free_port
from launcher.train.checkpoint import verify

SHORT = ("train.max_steps=30", "train.checkpoint_every_steps=10", "train.log_every_steps=5")


def test_rank_that_never_joins_is_named_with_the_address(tmp_path):
    start = time.monotonic()
    result = run_launcher(
        *SHORT, "cluster.join_timeout_s=4", run_dir=tmp_path, env={"LAUNCHER_FAULT": "step=0,rank=1,stall"}
    )
    assert result.returncode == 1
    assert re.search(
        r"ranks \[1\] did not join within 4 s \(cluster.join_timeout_s\) at 127\.0\.0\.1:\d+; "
        r"rank 0 on \S+ waited for them",
        result.stderr,
    ), result.stderr
    assert time.monotonic() - start < 60


def test_unreachable_master_is_named(tmp_path):
    port = free_port("127.0.0.1")  # nothing listens there
    env = {
        **os.environ,
        "TORCHELASTIC_RUN_ID": "t",
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    result = subprocess.run(
        [sys.executable, "-m", "launcher", f"hydra.run.dir={tmp_path}", "cluster.join_timeout_s=3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    log = (tmp_path / "logs" / "rank-1.log").read_text()  # ranks > 0 write stderr to their log
    assert (
        f"rank 1 on {os.uname().nodename} could not reach the rendezvous store at 127.0.0.1:{port} within 3 s" in log
    ), log[-3000:]


def test_node_agent_alone_times_out_naming_the_rendezvous(tmp_path):
    """A virtual node whose peers never start: its elastic agent gives up after cluster.join_timeout_s."""
    job, _ = plan("+cluster=sim", "cluster.join_timeout_s=3", run_dir=tmp_path)
    freeze(job)
    port = free_port("127.0.0.1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.launch.nodes.process",
            str(tmp_path),
            "2",
            "0",
            f"127.0.0.1:{port}",
            "runid",
            "127.0.0.1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert (
        f"launcher: node 0: the rendezvous at 127.0.0.1:{port} did not gather 2 nodes within 3 s "
        "(cluster.join_timeout_s)"
    ) in result.stderr, result.stderr[-3000:]


def test_stuck_rank_is_detected_and_named(tmp_path):
    """With the progress watch off (comm.hang_warn_s=0): the waiting ranks' own report after torch's timeout (with
    the watch on, tests/jobs/test_hangs.py: the culprit is named first, with its live stack)."""
    start = time.monotonic()
    result = run_launcher(
        *SHORT,
        "comm.timeout_s=5",
        "comm.hang_warn_s=0",
        run_dir=tmp_path,
        env={"LAUNCHER_FAULT": "step=12,rank=1,stall"},
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert re.search(
        r"rank 0 on \S+: a collective at step 12 timed out after 5 s \(comm.timeout_s\); "
        r"stuck: rank 1 on \S+ never reached it",
        result.stderr,
    ), result.stderr[-3000:]
    # the stuck rank was stopped and said where it was stuck, at once: rank 0's failure record says no stop
    # checkpoint can be agreed, so it does not wait the 25 s given to reach a step boundary
    rank1 = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "launcher: rank was stopped by SIGTERM after another rank failed, before reaching a step boundary" in rank1
    assert "in fire" in rank1
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.pt")) == ["step-00000010.pt"]
    assert elapsed < 40


def test_run_dir_is_not_world_writable_even_under_umask_000(tmp_path):
    """Every kind of file a run writes (config, logs, checkpoints, metrics, trace, plots, failure records,
    Hydra's own), the launcher started with umask 000: none may be writable by others."""
    run = tmp_path / "run"
    previous = os.umask(0)
    try:
        result = run_launcher(
            "train.max_steps=5",
            "train.log_every_steps=5",
            "comm.trace=true",
            "comm.trace_steps=1",
            run_dir=run,
            env={"LAUNCHER_FAULT": "step=5,rank=1"},
        )
    finally:
        os.umask(previous)
    assert result.returncode == 1, result.stderr  # the fault: failure records too
    written = [run, *run.rglob("*")]
    names = {p.name for p in written}
    expected = {"config.yaml", "hydra.yaml", "metrics.jsonl", "trace.json", "rank-1.log", "rank-1.json", "error.json"}
    assert expected <= names, expected - names
    loose = [f"{p} {oct(p.stat().st_mode)}" for p in written if p.stat().st_mode & 0o002]
    assert not loose, loose


def _mount_tmpfs(path, options):
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); needs root")


@pytest.fixture
def small_disk(tmp_path):
    """A 1.6 MB file system: room for one LeNet checkpoint (~1 MB) and the run's logs, not for two."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=1600k")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_full_disk_at_save_names_the_cause_and_keeps_the_previous_checkpoint(small_disk):
    run_dir = small_disk / "run"
    result = run_launcher(*SHORT, "train.keep_checkpoints=1", run_dir=run_dir)
    assert result.returncode == 1
    kept = run_dir / "checkpoints" / "step-00000010.pt"
    assert re.search(
        rf"rank 0 on \S+: cannot write checkpoint \S+step-00000020.pt at step 20 \(No space left on "
        rf"device\); the previous checkpoint {re.escape(str(kept))} is intact",
        result.stderr,
    ), result.stderr[-3000:]
    verify(kept)  # sha256 matches: the failed save did not touch it
    assert torch.load(kept, weights_only=False)["step"] == 10
    assert sorted(p.name for p in kept.parent.iterdir()) == ["step-00000010.pt", "step-00000010.pt.sha256"]


def test_read_only_run_dir_is_refused_before_start(tmp_path):
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=64k")
    try:
        result = run_launcher(*SHORT, run_dir=ro / "run")
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert result.returncode == 2
    assert (
        f"launcher: error: cannot write the run dir {ro / 'run'} (Read-only file system at {ro}); HINT: "
        "choose a writable place with hydra.run.dir=PATH" in result.stderr
    )
    assert "Traceback" not in result.stderr
