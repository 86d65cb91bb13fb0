"""Issue 46: an ordinary failure reads as one error. The failing rank's traceback shows the user's frames and the
trainer's step, never a healing frame or a keeper message, in a job that does not heal and in one that heals in
place (``+cluster=sim cluster.min_nodes=1``); the job fails naming the rank, exit 1."""

import re

import pytest

from harness.run import run_launcher

SHORT = ("train.max_steps=20", "data=synthetic", "model=mlp")
HEALING_FRAMES = ("_heal", "_go_on", "in_place.py", "rank_side.py", "head_side.py", "keeper")


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [(), ("+cluster=sim", "cluster.procs_per_node=1", "cluster.min_nodes=1")],
    ids=["local", "sim-heals"],
)
def test_an_ordinary_failure_shows_its_own_frames_only(tmp_path, mode):
    failed = run_launcher(*SHORT, *mode, run_dir=tmp_path, env={"LAUNCHER_FAULT": "step=5,rank=1"})
    assert failed.returncode == 1, failed.stderr
    said = re.search(r"launcher: rank 1 \([^)]*\) on \S+ failed:\n(.*?)\nlauncher: ", failed.stderr, re.S)
    assert said, failed.stderr
    console, log = said.group(1), (tmp_path / "logs" / "rank-1.log").read_text()
    traceback = log[log.rindex("Traceback (most recent call last)") :]
    assert "in _step" in traceback and "in fire_at" in traceback, traceback  # the trainer's step, then the fault
    assert traceback.rstrip().endswith("RuntimeError: injected fault at step 5 on rank 1 (LAUNCHER_FAULT)"), traceback
    assert console.endswith("RuntimeError: injected fault at step 5 on rank 1 (LAUNCHER_FAULT)"), console
    for text in (console, traceback):
        assert not [frame for frame in HEALING_FRAMES if frame in text], text
        assert "During handling of the above exception" not in text, text
