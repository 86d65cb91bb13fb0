"""Issue 47: a ``script=`` job keeps every line its ranks print, rank 0's included, in ``logs/rank-<k>.log``, while
the console shows rank 0's output as before; a rank killed by SIGKILL loses nothing it printed. The trainer's own
log lines are in rank 0's log once, not twice."""

import pytest

from harness.run import run_launcher

SCRIPT = "script=tests/scripts/gpt_style_script.py"


@pytest.mark.slow
def test_every_ranks_output_is_in_its_log_rank_0s_too(tmp_path):
    run = run_launcher(SCRIPT, "--", "--iters=3", "--lr=0.001", run_dir=tmp_path)  # as torchrun takes them
    assert run.returncode == 0, run.stderr
    iters = [f"iter {i}: loss 4.5000, lr 0.001" for i in range(3)]
    assert run.stdout.splitlines() == iters  # the console: rank 0's stdout, as under torchrun
    rank0 = (tmp_path / "logs" / "rank-0.log").read_text().splitlines()
    rank1 = (tmp_path / "logs" / "rank-1.log").read_text().splitlines()
    assert [line for line in rank0 if line.startswith("iter")] == iters
    assert [line for line in rank0 if "warning" in line] == [f"rank 0 warning at iter {i}" for i in range(3)]
    assert [line for line in rank1 if "warning" in line] == [f"rank 1 warning at iter {i}" for i in range(3)]


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_keeps_what_it_printed(tmp_path):
    run = run_launcher(SCRIPT, "--", "--iters=5", "--die_after=1", "--tag=last", run_dir=tmp_path)
    assert run.returncode != 0
    rank0 = (tmp_path / "logs" / "rank-0.log").read_text()
    assert "iter 1: loss 4.5000, lr 0.0006 last" in rank0 and "rank 0 warning at iter 0" in rank0, rank0
    assert "iter 2" not in rank0


@pytest.mark.slow
def test_the_trainers_log_lines_are_in_rank_0s_log_once(tmp_path):
    run = run_launcher("train.max_steps=4", "data=synthetic", "model=mlp", run_dir=tmp_path)
    assert run.returncode == 0, run.stderr
    rank0 = (tmp_path / "logs" / "rank-0.log").read_text()
    said = "epoch 0 step 4: test accuracy"
    assert rank0.count(said) == 1 and run.stderr.count(said) == 1, rank0
