"""A 2-rank DDP step computes the single-process full-batch gradient; 2-rank training keeps ranks identical."""

import json

import pytest
import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from harness.ranks import LAYOUTS, spawn_ranks, train_layout
from models import LeNet, resnet18


def _grad_parity(rank, world, out_dir, model_name):
    torch.manual_seed(0)
    make = {"lenet": LeNet, "resnet18": lambda: resnet18(num_classes=10)}[model_name]
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    if model_name == "resnet18":  # batch norm: compare in eval mode, where a shard's statistics don't matter
        model.eval()
        reference.eval()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 28, 28, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    shard = slice(rank * 16 // world, (rank + 1) * 16 // world)
    F.cross_entropy(ddp(x[shard]), y[shard]).backward()
    F.cross_entropy(reference(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_ddp_gradient_equals_full_batch_lenet(tmp_path):
    spawn_ranks(_grad_parity, 2, tmp_path, "lenet")


def test_ddp_gradient_equals_full_batch_resnet18(tmp_path):
    spawn_ranks(_grad_parity, 2, tmp_path, "resnet18")


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The independent reference: one process, the full global batch each step (no reducer at all)."""
    return train_layout(tmp_path_factory.mktemp("single"), "1x1")[0]["params"]


@pytest.mark.parametrize(
    "reducer, layout, hierarchical",
    [
        ("ddp", "1x2", "false"),
        ("bucketed", "1x2", "false"),
        ("ddp", "2x2", "true"),
        ("bucketed", "2x2", "true"),
        ("bucketed", "2x2", "auto"),
    ],
)
def test_training_keeps_ranks_identical_with_each_reducer(tmp_path, single_process, reducer, layout, hierarchical):
    world = LAYOUTS[layout][0]
    run = tmp_path / "run"
    # in 2 micro-batches per rank (train.accumulate_steps; the reference takes each global batch whole): the
    # gradients are synchronised once per step, and the step is still the whole batch's (tests/ranks/test_step.py)
    overrides = (f"comm.reducer={reducer}", f"comm.hierarchical={hierarchical}", "train.accumulate_steps=2")
    results = train_layout(tmp_path, layout, *overrides)
    for r in range(1, world):
        for name, value in results[0]["params"].items():
            assert torch.equal(value, results[r]["params"][name]), f"{name} differs on rank {r}"
    summary = results[0]["summary"]
    assert summary["reducer"] == reducer and summary["world_size"] == world
    if hierarchical != "auto":
        assert summary["hierarchical"] == (hierarchical == "true")
    losses = [
        r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    ]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], losses
    # every reducer, layout and strategy, in micro-batches, trains what one process on the full batch trains (up to
    # float order)
    for name, value in results[0]["params"].items():
        torch.testing.assert_close(value, single_process[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
