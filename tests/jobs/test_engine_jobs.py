"""``launcher.Engine`` in a script the launcher runs (``tests/scripts/engine_loop.py``, docs/your-loop.md's example):
on 2 simulated nodes x 2 ranks its loss trajectory is one process's on the whole global batch (replicated; sharded:
tests/ranks/test_engine.py), the job's ``comm.*`` on the command line reach the script's engine, and ``python -m
launcher export`` says how to load what a user's loop wrote."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.run import run_launcher, start_head, user_env

SIM_2X2 = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2", "train.threads_per_rank=1")
SCRIPT = "script=tests/scripts/engine_loop.py"
EPOCHS, BATCH, SAMPLES = 2, 32, 256


def one_process_losses() -> list[float]:
    """engine_loop.py's model, data and optimizer on one process, the whole global batch a step."""
    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(SAMPLES, 16, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_a_loop_through_the_engine_on_two_simulated_nodes_follows_one_process(tmp_path):
    """Replicated (torch DDP) only: the Engine's sharded loop against one process is
    tests/ranks/test_engine.py's (on real ranks); what the launcher adds (its simulated nodes' environment handed to
    the script's engine) is the same for both reducers."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    run = run_launcher(*SIM_2X2, SCRIPT, "comm.hierarchical=true", "--", str(out), run_dir=run_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [line.split() for line in (out / "losses-0.txt").read_text().splitlines()]
    assert [int(s) for s, _ in steps] == list(range(1, EPOCHS * SAMPLES // BATCH + 1))
    torch.testing.assert_close([float(v) for _, v in steps], one_process_losses(), rtol=1e-4, atol=1e-6)
    said = (run_dir / "logs" / "rank-0.log").read_text()
    assert "launcher.Engine: torch DDP" in said and "topology 2 node(s) (2+2 ranks)" in said, said[-2000:]
    argv = [sys.executable, "-m", "launcher", "export", str(run_dir), str(tmp_path / "model.pt")]
    exported = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=user_env())
    assert exported.returncode == 0, exported.stderr
    assert "model = YourModel(); model.load_state_dict(" in exported.stdout, exported.stdout
    final = torch.load(out / "final.pt")
    assert all(torch.equal(v, final[k]) for k, v in torch.load(tmp_path / "model.pt").items())


@pytest.mark.slow
def test_the_jobs_comm_settings_reach_the_scripts_engine(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    run = run_launcher(
        *SIM_2X2, SCRIPT, "comm.compress=bf16", "comm.hierarchical=true", "--", str(out), "--epochs=1", run_dir=run_dir
    )
    assert run.returncode == 0, run.stderr[-3000:]
    said = (run_dir / "logs" / "rank-0.log").read_text()
    assert "launcher.Engine: torch DDP" in said and "bf16" in said.split("launcher.Engine:")[1].splitlines()[0], said


@pytest.mark.slow
def test_under_plain_torchrun_the_engine_takes_the_defaults_and_a_second_run_resumes(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    argv = [*torchrun, f"--log-dir={tmp_path / 'torchrun'}", "tests/scripts/engine_loop.py", str(out)]
    argv += ["--epochs=1", f"--run-dir={run_dir}"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=user_env())
    assert first.returncode == 0, first.stderr[-3000:]
    assert "launcher.Engine: torch DDP" in first.stdout and "rank 0: 8 steps, resumed from nothing" in first.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt")) == ["step-00000008.pt"]
    again = subprocess.run(
        [*argv[:-2], "--epochs=2", argv[-1]], capture_output=True, text=True, timeout=300, env=user_env()
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rank 0: 16 steps, resumed from {'epochs_done': 1}" in again.stderr, again.stderr[-3000:]
    steps = [int(line.split()[0]) for line in (out / "losses-0.txt").read_text().splitlines()]
    assert steps == list(range(1, 17))  # the second run went on from step 8


@pytest.mark.slow
def test_ctrl_c_stops_a_loop_through_the_engine_at_one_step_and_it_resumes_on_another_layout(tmp_path):
    """On 2 simulated nodes x 2, Ctrl-C reaches every rank (the launcher forwards it); the engine stops them at one
    step boundary with one checkpoint and ends them 130; run again on 1 node x 2 with the same run dir it goes on from
    that step."""
    out, run_dir, log = tmp_path / "out", tmp_path / "run", tmp_path / "head.log"
    loop = (SCRIPT, "train.checkpoint_every_steps=0", "--", str(out), "--samples=40000", "--epochs=1")
    head = start_head(run_dir, *SIM_2X2, *loop, log=log)
    try:
        deadline, losses = time.monotonic() + 180, out / "losses-0.txt"
        while not losses.exists() or len(losses.read_text().splitlines()) < 5:
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(head.pid, signal.SIGINT)  # Ctrl-C
        assert head.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    [checkpoint] = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    step = int(checkpoint.stem.split("-")[1])
    said = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"launcher.Engine: stopped at step {step} on SIGINT" in said, said[-3000:]
    assert "how the script's ranks ended: ranks 0, 1, 2, 3 on " in log.read_text(), log.read_text()[-2000:]
    assert " exited 130 (" in log.read_text(), log.read_text()[-2000:]  # (SystemExit(128 + SIGINT) from the engine)
    again = run_launcher("cluster.procs_per_node=2", *loop, run_dir=run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [int(line.split()[0]) for line in (out / "losses-0.txt").read_text().splitlines()]
    resumed = steps[steps.index(step + 1) :]
    assert resumed == list(range(step + 1, 40000 // BATCH + 1)), resumed[:5]
