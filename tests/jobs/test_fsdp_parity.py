"""Sharded training (``comm.reducer=fsdp``: FSDP2 inside a node, our stage across nodes) trains what one process
trains on the whole global batch, and what torch DDP trains: on 2 nodes x 2 real gloo ranks, node-first and flat,
in micro-batches and with clipping; bf16 within bf16's tolerance of DDP under the same precision."""

import json

import pytest
import torch

from harness.ranks import train_layout

pytestmark = pytest.mark.slow
FSDP = ("comm.reducer=fsdp", "comm.fsdp_min_params=1000")  # the MLP's layers each a unit (several hooks a step)


def assert_close(params, reference, rtol=1e-4, atol=1e-5):
    assert params.keys() == reference.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, reference[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").open()) if r["kind"] == "train"]


CLIPPED = ("optim.clip_grad_norm=0.5",)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The independent reference: one process, the whole global batch each step."""
    return train_layout(tmp_path_factory.mktemp("one"), "1x1")[0]["params"]


@pytest.fixture(scope="module")
def one_process_clipped(tmp_path_factory):
    return train_layout(tmp_path_factory.mktemp("clipped"), "1x1", *CLIPPED)[0]["params"]


@pytest.mark.parametrize(
    "layout, shard, clip", [("2x2", "node", ()), ("2x2", "world", ()), ("1x2", "node", ()), ("2x2", "node", CLIPPED)]
)
def test_sharded_training_follows_one_process(tmp_path, one_process, one_process_clipped, layout, shard, clip):
    """40 steps in 2 micro-batches a rank (clipped: the norm over every shard, after our stage summed them across
    nodes under comm.shard=node): the gathered weights are one process's to float order, on every rank alike."""
    job = (*FSDP, f"comm.shard={shard}", "train.accumulate_steps=2", *clip)
    results = train_layout(tmp_path, layout, *job)
    summary = results[0]["summary"]
    assert summary["reducer"] == "fsdp" and summary["hierarchical"] == (shard == "node" and layout == "2x2")
    for result in results[1:]:
        for name, value in results[0]["params"].items():
            assert torch.equal(value, result["params"][name]), name
    assert_close(results[0]["params"], one_process_clipped if clip else one_process)
    if clip:  # clipping changed the training: the comparison above can fail
        with pytest.raises(AssertionError):
            assert_close(one_process_clipped, one_process)
    assert losses(tmp_path / "run")[-1] < 0.5 * losses(tmp_path / "run")[0]


def test_sharded_training_follows_ddp_under_bf16(tmp_path):
    """bf16: the sharded forward computes in bf16 weights (FSDP2's param dtype), DDP's under autocast; both reduce
    in fp32. Low-precision trajectories drift with any change of summation order (one process against itself
    included: tests/jobs/test_step.py), so 20 steps are compared at bf16's tolerance."""
    common = ("train.precision=bf16", "train.max_steps=20")
    ddp = train_layout(tmp_path / "ddp", "2x2", "comm.reducer=ddp", *common)
    ours = train_layout(tmp_path / "ours", "2x2", *FSDP, *common)
    assert_close(ours[0]["params"], ddp[0]["params"], rtol=2e-2, atol=2e-3)
    assert losses(tmp_path / "ours" / "run")[-1] < 0.7 * losses(tmp_path / "ours" / "run")[0]
