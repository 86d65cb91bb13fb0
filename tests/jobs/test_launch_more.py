"""End to end, as a user runs it: ``python -m launcher`` (elastic agent, real gloo ranks), the jobs that need no
uninterrupted reference: the default job, one rank, a script, the listeners, sweeps, refused resumes and ports, a
resume on another world size and one that keeps its buckets. The jobs resumed against one uninterrupted run:
test_launch.py (apart: each module is one xdist group)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import torch

from harness import REPO
from harness.checks import assert_same_training_state, assert_same_trajectory, assert_trained_once_up_to, final_state
from harness.run import run_launcher, user_env, wait_first_checkpoint

SHORT = ("train.max_steps=30", "train.checkpoint_every_steps=10", "train.log_every_steps=5")
SUMMARY_KEYS = {
    "hosts",
    "world_size",
    "nodes",
    "procs_per_node",
    "backend",
    "reducer",
    "hierarchical",
    "epochs",
    "steps",
    "final_loss",
    "test_accuracy",
    "samples_per_s",
    "wall_s",
    "resumed_from",
}


def test_default_job_trains_digits_to_95_percent(tmp_path):
    result = run_launcher(run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert (summary["world_size"], summary["nodes"], summary["procs_per_node"]) == (2, 1, 2)
    assert (summary["backend"], summary["reducer"], summary["hierarchical"]) == ("gloo", "ddp", False)
    assert summary["test_accuracy"] >= 0.95 and summary["resumed_from"] is None
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert {"step", "epoch", "loss", "samples_per_s", "step_s"} <= train[0].keys()
    assert train[-1]["loss"] < train[0]["loss"] / 4
    assert [r["epoch"] for r in records if r["kind"] == "eval"] == list(range(10))
    for rank in (0, 1):
        assert f"rank {rank}/2" in (tmp_path / "logs" / f"rank-{rank}.log").read_text()
    assert "test accuracy" in result.stderr and "done: 220 steps" in result.stderr
    assert "model:\n  _target_: models.lenet.LeNet" in (tmp_path / "config.yaml").read_text()


def test_one_rank_with_max_restarts_is_restarted_too(tmp_path):
    """One rank runs in the launcher's process, unless cluster.max_restarts asks for restarts: then the agent starts
    it, restarts it after its failure (announced with the error) and it resumes from the checkpoint."""
    fault = {"LAUNCHER_FAULT": "step=15,rank=0,attempt=0"}
    result = run_launcher(*SHORT, "cluster.procs_per_node=1", "cluster.max_restarts=1", run_dir=tmp_path, env=fault)
    assert result.returncode == 0, result.stderr[-3000:]
    said = r"^launcher: attempt 0 ended: rank 0 \(pid \d+\) on \S+ failed: RuntimeError: injected fault at step 15"
    assert re.search(said, result.stderr, re.M), result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [a["ended"] for a in summary["attempts"]] == ["failed", "finished"] and summary["world_size"] == 1
    assert summary["resumed_from"].endswith("step-00000010.pt") and summary["steps"] == 30, summary


def test_single_rank_runs_in_process(tmp_path):
    result = run_launcher("cluster.procs_per_node=1", "train.max_steps=5", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (1, 5)


def test_script_mode_runs_a_torchrun_script_unchanged(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_launcher("script=tests/scripts/allreduce_script.py", f"script_args=[{out}]", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [(out / f"rank-{r}.txt").read_text() for r in (0, 1)] == ["3 3", "3 3"]
    assert "script rank 1 done" in (tmp_path / "logs" / "rank-1.log").read_text()


def test_store_and_gloo_listen_on_loopback_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_launcher("script=tests/scripts/listeners_script.py", f"script_args=[{out}]", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    listeners = (out / "listeners.txt").read_text().split("\n")
    addrs = [line.split()[3] for line in listeners if line.strip()]
    assert len(addrs) >= 3, listeners  # the agent's rendezvous store and each rank's gloo pairs
    assert all(a.startswith("127.0.0.1:") for a in addrs), listeners


def test_local_sweep_reports_every_point(tmp_path):
    result = run_launcher(
        "-m",
        "cluster.procs_per_node=1",
        "train.max_steps=5",
        "optim.lr=0.1,0.05",
        "cluster.nodes=0,1",
        f"hydra.sweep.dir={tmp_path}",
        run_dir=tmp_path / "unused",
    )
    assert result.returncode == 1  # one point is invalid: the sweep says so, the others still ran
    assert "launcher: error: cluster.nodes=0 must be >= 1" in result.stderr
    assert result.stderr.count(": ok, final loss") == 2 and result.stderr.count("FAILED (exit 2)") == 2


def test_a_stop_signal_to_a_sweep_stops_the_point_running_and_starts_no_other(tmp_path):
    """Issue 36: the sweep's head did not pass a stop on: SIGTERM stopped the point running, then Hydra started the
    next one. Now the point checkpoints, no later point starts, every point is reported, the head exits 143."""
    sweep, log = tmp_path / "sweep", tmp_path / "head.log"
    argv = [sys.executable, "-m", "launcher", "-m", f"hydra.sweep.dir={sweep}", "cluster.procs_per_node=1"]
    argv += ["train.epochs=200", "train.checkpoint_every_steps=20", "optim.lr=0.1,0.05"]
    with open(log, "w") as stderr:
        head = subprocess.Popen(
            argv, cwd=REPO, env=user_env(), stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
        )
    try:
        wait_first_checkpoint(head, sweep / "0", log)
        os.kill(head.pid, signal.SIGTERM)
        assert head.wait(timeout=30) == 143, log.read_text()[-3000:]
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    stderr = log.read_text()
    assert "optim.lr=0.1: stopped by SIGTERM (exit 143)" in stderr, stderr[-3000:]
    assert "the sweep was stopped by SIGTERM: later points not run" in stderr, stderr[-3000:]
    assert not (sweep / "1").exists(), "the second point started after the stop"


def test_resume_into_a_different_job_is_refused(tmp_path):
    first = run_launcher("train.max_steps=5", run_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    other = run_launcher("train.max_steps=5", "model=mlp", "cluster.procs_per_node=1", run_dir=tmp_path)
    assert other.returncode == 2
    assert (
        "holds checkpoints of a different job (model._target_: 'models.lenet.LeNet' -> 'models.mlp.MLP'" in other.stderr
    )
    assert (
        "HINT: use a new hydra.run.dir, train.resume=never to start over there, or train.resume=force" in other.stderr
    )
    # another world size is fine, another global batch is not
    per_rank = run_launcher("train.batch_size_per_rank=32", "cluster.procs_per_node=1", run_dir=tmp_path)
    assert per_rank.returncode == 2
    assert (
        "holds checkpoints of a different job (global batch: 64 -> 32 (world size 2 -> 1; train.batch_size=64 "
        "train.batch_size_per_rank=null keeps it))" in per_rank.stderr
    )
    forced = run_launcher("train.max_steps=5", "cluster.procs_per_node=1", "train.resume=force", run_dir=tmp_path)
    assert forced.returncode == 0, forced.stderr


def test_resume_on_another_world_size_follows_the_same_trajectory(tmp_path, tmp_path_factory):
    """4 ranks for 10 steps, resumed on 2 ranks to step 20, vs one process throughout: each global batch holds the
    same samples whatever the world size (rank r takes positions r, r + W, ... of the epoch's permutation, so a
    global batch is one contiguous block of it), so only float32 summation order differs (per-rank means of 16 or
    32 samples averaged over 4 or 2 ranks, vs one mean of 64): ~1e-7 relative per step, grown by 20 steps of SGD
    with momentum (``assert_same_trajectory``)."""
    job = ("train.checkpoint_every_steps=10", "train.log_every_steps=5", "optim.schedule_steps=20")
    first = run_launcher(*job, "train.max_steps=10", "cluster.procs_per_node=4", run_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = run_launcher(*job, "train.max_steps=20", "cluster.procs_per_node=2", run_dir=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming a 4-rank checkpoint on 2 ranks: global batch 64 as before, the same samples from step 10" in (
        resumed.stderr
    )
    assert_trained_once_up_to(tmp_path, 10)
    whole = tmp_path_factory.mktemp("one-rank")  # the reference: one process, each whole global batch
    again = run_launcher(*job, "train.max_steps=20", "cluster.procs_per_node=1", run_dir=whole)
    assert again.returncode == 0, again.stderr
    a, b = final_state(tmp_path), final_state(whole)
    assert a["step"] == b["step"] == 20 and a["world_size"] == 2 and b["world_size"] == 1
    assert_same_trajectory(a, b)


def test_taken_master_port_is_refused_before_start(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_launcher(f"cluster.master_port={port}", run_dir=tmp_path, timeout=60)
    assert result.returncode == 2
    assert f"launcher: error: cluster.master_port={port} on 127.0.0.1 is not free" in result.stderr
    assert "HINT: cluster.master_port=0 lets the launcher take a free port" in result.stderr


def test_resumed_run_keeps_its_multi_bucket_layout(tmp_path, tmp_path_factory):
    """The bucket cap measured at the first start is kept in the checkpoint: a resumed run reduces in the same
    buckets (the same summation order), however the link measures now. With the forward overlap (the default):
    the checkpoint holds the fully updated state, so the resumed run ends bit-identical to an uninterrupted one."""
    job = ("model=mlp", "model.hidden=512", "comm.reducer=bucketed", "train.checkpoint_every_steps=10")
    job += ("optim.schedule_steps=20",)  # stopped at 10, extended to 20 along the 20-step schedule
    first = run_launcher(*job, "train.max_steps=10", run_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    layout = re.search(
        r"gradient sync  bucketed, cap [\d.]+ MB \(([^)]*)\)[^:]*: (\d+ bucket\(s\) \[[^\]]*\])", first.stderr
    )
    assert layout and int(layout.group(2).split()[0]) >= 2, first.stderr[-2000:]  # several buckets
    resumed = run_launcher(*job, "train.max_steps=20", run_dir=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"(kept from the checkpoint this run resumes): {layout.group(2)}" in resumed.stderr, resumed.stderr[-2000:]
    # the first layer's gradient sent early in the uninterrupted run, not in the resumed one's warm-up: same bits
    assert ", forward overlap, net.1.weight's gradient sent as its rows are computed;" in resumed.stderr
    whole = tmp_path_factory.mktemp("whole")
    cap = torch.load(tmp_path / "checkpoints" / "step-00000010.pt", weights_only=True)["bucket_cap_mb"]
    again = run_launcher(*job, "train.max_steps=20", f"comm.bucket_cap_mb={cap!r}", run_dir=whole)
    assert again.returncode == 0, again.stderr
    assert layout.group(2) in again.stderr
    assert_same_training_state(final_state(tmp_path), final_state(whole))
