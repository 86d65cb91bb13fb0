"""Issue 48 (item 4): a resume logs what the uninterrupted run logs. A run stopped mid-window (SIGTERM to the
launcher, as ``kill`` or Ctrl-C) and run again with the same run dir writes the same train records as the run that
was never stopped: the loss window the stop cut goes on from each rank's partial sums in the checkpoint
(``progress.Totals``), so the first record after the resume averages the whole window, not the steps since it. On
another world size the window restarts at the resume step, and the resume says so."""

import json

import pytest
import torch

from harness.checks import final_state
from harness.run import run_launcher
from launcher.train.progress import Totals

LOG_EVERY = 10
JOB = ("train.max_steps=30", "train.checkpoint_every_steps=10", f"train.log_every_steps={LOG_EVERY}")
STOP = {"LAUNCHER_FAULT": "step=13,signal=TERM,target=parent"}  # rank 0 signals the launcher before step 13


def records(run_dir, kind):
    """``kind`` records of metrics.jsonl by step (the last one written at a step)."""
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in lines if r.get("kind") == kind}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_launcher(*JOB, run_dir=run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def stopped_mid_window(run_dir):
    """The job stopped by SIGTERM at a step boundary between two logs (13 or a bit later); its step."""
    stopped = run_launcher(*JOB, run_dir=run_dir, env=STOP)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    state = final_state(run_dir)
    step = state["step"]
    assert 13 <= step < 30 and step % LOG_EVERY, (step, stopped.stderr[-3000:])  # a window cut short
    return step, state


def test_resumed_run_logs_the_uninterrupted_runs_loss_at_every_step(tmp_path, uninterrupted):
    step, state = stopped_mid_window(tmp_path)
    window = state["log_window"]  # every rank's partial window: its own sums since the last log, and their time
    assert len(window) == state["world_size"] == 2, window
    logged = step - step % LOG_EVERY
    assert [(w["from_step"], w["sums"][1]) for w in window] == [(logged, float(step - logged))] * 2, window
    assert all(w["sums"][0] > 0 and w["elapsed_s"] > 0 for w in window), window

    resumed = run_launcher(*JOB, run_dir=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from"].endswith(f"step-{step:08d}.pt")
    train, expected = records(tmp_path, "train"), records(uninterrupted, "train")
    assert sorted(train) == sorted(expected) == [10, 20, 30], (sorted(train), sorted(expected))
    for at in expected:  # the loss to the bit (each rank's sums in the same order), and what goes with it
        got = {k: train[at][k] for k in ("step", "epoch", "loss", "lr")}
        assert got == {k: expected[at][k] for k in got}, (at, train[at], expected[at])
    evals = records(tmp_path, "eval")
    assert {s: e["test_loss"] for s, e in evals.items()} == {
        s: e["test_loss"] for s, e in records(uninterrupted, "eval").items()
    }
    # the cut window's time per step counts the steps before the checkpoint too (their time, saved): over the
    # whole window, never less than what rank 0 had spent on it when it stopped
    after = min(s for s in train if s > step)
    assert train[after]["step_s"] * LOG_EVERY >= window[0]["elapsed_s"], (train[after], window[0])


def test_resume_on_another_world_size_restarts_the_window_and_says_so(tmp_path, uninterrupted):
    step, _ = stopped_mid_window(tmp_path)
    resumed = run_launcher(*JOB, "cluster.procs_per_node=1", run_dir=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"resuming a 2-rank checkpoint on 1 ranks: global batch 64 as before, the same samples from step {step}; "
        "the train loss's window restarts there (the first train record averages the steps from it)"
    ) in resumed.stderr, resumed.stderr[-3000:]
    train = records(tmp_path, "train")
    assert sorted(train) == [10, 20, 30] and train[30]["loss"] > 0, train


def test_window_parts_carry_sums_steps_and_time():
    """In one process: a rank's part of the window goes into the checkpoint and back whole, its time counting the
    saved seconds; after a heal every rank takes the window's start and the longest time of the ranks that ran it
    (a rank that joins has run none: 0 s, step 0)."""
    before = Totals.on(torch.device("cpu"))
    before.start(0)
    before.window[:2] += torch.tensor([2.5, 3.0], dtype=torch.float64)
    before.exposed_s, before.window_t0 = 0.25, before.window_t0 - 40.0  # 40 s into the window
    saved = before.partial()
    assert saved["from_step"] == 0 and saved["sums"] == [2.5, 3.0, 0.25] and 40.0 <= saved["elapsed_s"] < 41.0

    resumed = Totals.on(torch.device("cpu"))
    resumed.start(3, saved)
    assert resumed.window.tolist() == [2.5, 3.0, 0.0] and resumed.exposed_s == 0.25 and resumed.window_from == 0
    assert 40.0 <= resumed.elapsed_s() < 41.0  # the saved time, then this process's
    other_world = Totals.on(torch.device("cpu"))
    other_world.start(3)
    assert other_world.window.tolist() == [0.0] * 3 and other_world.window_from == 3 and other_world.elapsed_s() < 1

    joined = Totals.on(torch.device("cpu"))
    assert joined.counts() == (-1, -1, 0, 0, 0.0)  # not trained here: no window of its own
    joined.take_highest([joined.counts(), (10, 10, 13, 10, 30.0), (10, 10, 12, 10, 29.5)])
    assert (joined.logged_step, joined.saved_step, joined.trained_steps, joined.window_from) == (10, 10, 13, 10)
    assert 30.0 <= joined.elapsed_s() < 31.0
