"""The optimizer on FSDP2's shards (docs/configuration.md): AdamW runs torch's fused kernel on the DTensor shards;
SGD runs unfused there (torch has no DTensor rule for the fused SGD kernel) and fused on plain tensors. On 2 real
gloo ranks of one node, the model sharded as a ``comm.reducer=fsdp`` job shards it. The fused AdamW steps the shards
as torch's plain AdamW steps the whole tensors (an independent reference: a copy of the model before sharding, the
same gradients), and is still fused after its steps."""

import pytest
import torch

from harness.config import plan
from harness.ranks import spawn_ranks, virtual_env

JOB = ("model=mlp", "model.hidden=8", "data.image_size=6", "comm.reducer=fsdp", "comm.fsdp_min_params=1")
STEPS = 3


def _fused(rank, world, out_dir, job):
    import copy

    from torch.distributed.tensor import DTensor, distribute_tensor

    from launcher.train.model import build_model, shard
    from launcher.train.optim import build_optimizer

    device = torch.device("cpu")
    model = build_model(job, device)
    whole = copy.deepcopy(model)  # the same weights, never sharded: the reference's
    shard(job, virtual_env(rank, world, world), device, model)
    shards = {name: p for name, p in model.named_parameters() if isinstance(p, DTensor)}
    assert len(shards) == len(list(model.parameters()))
    plain, got = build_model(job, device), {}
    for name in ("adamw", "sgd"):
        cfg = job.optim.__class__(**{**vars(job.optim), "name": name, "weight_decay": 0.1})
        got[name] = {"sharded": build_optimizer(cfg, model, world), "plain": build_optimizer(cfg, plain, 1)}
    fused = {name: {k: bool(o.defaults.get("fused")) for k, o in opts.items()} for name, opts in got.items()}
    # the sharded AdamW's steps, and torch's plain (unfused, one tensor at a time) AdamW's on the whole tensors
    adamw = got["adamw"]["sharded"]
    reference = torch.optim.AdamW(whole.parameters(), lr=job.optim.lr, weight_decay=0.1, foreach=False, fused=False)
    initial = {name: q.detach().clone() for name, q in whole.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for (name, p), (same, q) in zip(shards.items(), whole.named_parameters()):
            assert name == same, (name, same)
            q.grad = torch.randn(q.shape, generator=gen)  # (every rank draws the same)
            p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements)
        adamw.step()
        reference.step()
    steps = {
        "fused": [bool(group["fused"]) for group in adamw.param_groups],  # (still fused: not unfused in its step)
        "sharded": {name: p.full_tensor() for name, p in shards.items()},  # (collective)
        "whole": {name: q.detach().clone() for name, q in whole.named_parameters()},
        "initial": initial,
    }
    torch.save({"fused": fused, "steps": steps}, out_dir / f"fused-{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fused")
    job, _ = plan(*JOB, "cluster.procs_per_node=2", run_dir=tmp_path / "run")
    spawn_ranks(_fused, 2, tmp_path, job)
    return [torch.load(tmp_path / f"fused-{rank}.pt") for rank in (0, 1)]


def test_adamw_runs_fused_on_the_shards_and_sgd_unfused(ranks):
    for seen in ranks:
        assert seen["fused"] == {
            "adamw": {"sharded": True, "plain": True},
            "sgd": {"sharded": False, "plain": True},
        }


def test_the_fused_adamw_steps_the_shards_as_plain_adamw_steps_the_whole_tensors(ranks):
    for seen in ranks:
        steps = seen["steps"]
        assert steps["fused"] and all(steps["fused"]), steps["fused"]
        assert steps["whole"], steps
        for name, whole in steps["whole"].items():
            assert not torch.equal(whole, steps["initial"][name]), f"{name}: AdamW did not move it"
        torch.testing.assert_close(steps["sharded"], steps["whole"], rtol=1e-6, atol=1e-7)  # (it names the tensor)
