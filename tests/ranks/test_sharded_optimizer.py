"""The optimizer on FSDP2's shards (docs/configuration.md): AdamW runs torch's fused kernel on the DTensor shards;
SGD runs unfused there (torch has no DTensor rule for the fused SGD kernel) and fused on plain tensors. On 2 real
gloo ranks of one node, the model sharded as a ``comm.reducer=fsdp`` job shards it."""

import torch

from harness.config import plan
from harness.ranks import spawn_ranks, virtual_env

JOB = ("model=mlp", "model.hidden=8", "data.image_size=6", "comm.reducer=fsdp", "comm.fsdp_min_params=1")


def _fused(rank, world, out_dir, job):
    from torch.distributed.tensor import DTensor

    from launcher.train.model import build_model, shard
    from launcher.train.optim import build_optimizer

    device = torch.device("cpu")
    model = build_model(job, device)
    shard(job, virtual_env(rank, world, world), device, model)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    plain, got = build_model(job, device), {}
    for name in ("adamw", "sgd"):
        cfg = job.optim.__class__(**{**vars(job.optim), "name": name})
        got[name] = {"sharded": build_optimizer(cfg, model, world), "plain": build_optimizer(cfg, plain, 1)}
    fused = {name: {k: bool(o.defaults.get("fused")) for k, o in opts.items()} for name, opts in got.items()}
    torch.save(fused, out_dir / f"fused-{rank}.pt")


def test_adamw_runs_fused_on_the_shards_and_sgd_unfused(tmp_path):
    job, _ = plan(*JOB, "cluster.procs_per_node=2", run_dir=tmp_path / "run")
    spawn_ranks(_fused, 2, tmp_path, job)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"fused-{rank}.pt") == {
            "adamw": {"sharded": True, "plain": True},
            "sgd": {"sharded": False, "plain": True},
        }
