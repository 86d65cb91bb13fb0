"""comm.compress in the launcher's own job: a one-node job compresses nothing and says so; a compressed job on two
(virtual) nodes continues bit for bit from a checkpoint (each rank's error feedback and Qs saved per rank)."""

import torch

from harness.checks import assert_same_training_state, final_state
from harness.ranks import train_layout
from harness.run import run_launcher

COMPRESSED = (
    "comm.compress=powersgd",
    "comm.compress_warmup_steps=2",
    "comm.powersgd_rank=2",
    "comm.hierarchical=true",
)
SPAN = ("optim.schedule_steps=12", "train.checkpoint_every_steps=6", "train.threads_per_rank=1")


def test_one_node_compresses_nothing_and_says_so(tmp_path):
    result = run_launcher("comm.compress=powersgd", "train.max_steps=2", "cluster.procs_per_node=1", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "comm.compress=powersgd: one node, nothing crosses nodes: nothing compressed" in result.stderr


def test_a_compressed_run_resumes_bit_identical(tmp_path):
    """2 virtual nodes x 2 ranks: 12 steps straight, against 6 then 6 more from the checkpoint."""
    straight = train_layout(tmp_path / "straight", "2x2", *COMPRESSED, *SPAN, "train.max_steps=12")
    said = "PowerSGD rank 2 across nodes (after 2 step(s) uncompressed)"
    assert straight[0]["summary"]["compression"] == said, straight[0]["summary"]
    train_layout(tmp_path / "stopped", "2x2", *COMPRESSED, *SPAN, "train.max_steps=6")
    saved = final_state(tmp_path / "stopped" / "run")["compression"]
    assert len(saved) == 4 and all(s["errors"] for s in saved), [sorted(s) for s in saved]  # each rank its own
    assert not torch.equal(saved[0]["errors"][0], saved[1]["errors"][0])
    train_layout(tmp_path / "stopped", "2x2", *COMPRESSED, *SPAN, "train.max_steps=12")
    assert_same_training_state(final_state(tmp_path / "stopped" / "run"), final_state(tmp_path / "straight" / "run"))
