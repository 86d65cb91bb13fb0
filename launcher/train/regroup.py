"""A sharded job healing in place (``comm.reducer=fsdp``, ``comm.shard=node``): its model and optimizer on the next
round's mesh, from memory.

Node first, every node holds a whole replica, sharded among its own ranks: a rank's shards are those of its place in
its node (``local_rank``), and a heal keeps every rank's local place. So a survivor's shards are already the ones it
holds in the next round; only the groups change (the old round's are left behind with its default group). FSDP2 has
no call to move a sharded module to another mesh, so the model is built and sharded again on the new one (built as
at the start: the job's seed, this rank's random streams kept) and this rank's shards are copied in; its optimizer
is built again around the new parameters and takes the old one's state, tensor for tensor (no gather, no traffic).
A rank joining the job shards the model it built at its start, and takes its shards from a survivor at its own local
place (``heal.rank_side.agree_on_state``'s lanes): what ``local_state`` gives and ``load_local_state`` takes.
The trainer's call: ``ShardedState.regroup`` (``train/state.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from launcher.train.optim import is_dtensor, load_optimizer_state


def _local(t: torch.Tensor, clone: bool) -> torch.Tensor:
    local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    return local.detach().clone() if clone else local.detach()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer, clone: bool = False) -> dict[str, Any]:
    """This rank's part of the model and optimizer: each parameter's local shard, every buffer, the optimizer's
    state with each sharded tensor as its local shard (``sharded``: which ones, to make them shards again).
    ``clone``: copies (to send: a shard is a view of a padded buffer), else the tensors themselves."""
    saved = optimizer.state_dict()
    sharded = {i: [k for k, v in entry.items() if is_dtensor(v)] for i, entry in saved["state"].items()}
    state = {
        i: {k: _local(v, clone) if torch.is_tensor(v) else v for k, v in entry.items()}
        for i, entry in saved["state"].items()
    }
    return {
        "params": {name: _local(p, clone) for name, p in model.named_parameters()},
        "buffers": {name: _local(b, clone) for name, b in model.named_buffers()},
        "optimizer": {"state": state, "param_groups": saved["param_groups"]},
        "sharded": sharded,
    }


@torch.no_grad()
def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, local: dict[str, Any]) -> None:
    """``local_state``'s tensors into this rank's shards of ``model`` (sharded on a mesh where this rank holds the
    same place) and into ``optimizer``, built around its parameters."""
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    if set(params) != set(local["params"]) or set(buffers) != set(local["buffers"]):
        raise RuntimeError(f"a healed rank's state names other tensors than its model ({type(model).__name__})")
    mine = {**{n: _local(p, clone=False) for n, p in params.items()}, **buffers}
    theirs = {**local["params"], **local["buffers"]}
    if wrong := [
        f"{n} {tuple(t.shape)} != {tuple(mine[n].shape)}" for n, t in theirs.items() if t.shape != mine[n].shape
    ]:
        raise RuntimeError(f"a healed rank's shards are not shaped as its own (another place's?): {', '.join(wrong)}")
    for name, t in theirs.items():
        mine[name].copy_(t)
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, entry in local["optimizer"]["state"].items():
        p, keys = ordered[i], set(local["sharded"].get(i, ()))
        state[i] = {k: _shard_like(v, p) if k in keys else v for k, v in entry.items()}
    load_optimizer_state(optimizer, {"state": state, "param_groups": local["optimizer"]["param_groups"]})


def _shard_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local``, this rank's shard of a tensor shaped and placed as parameter ``p``, as a DTensor on ``p``'s mesh."""
    from torch.distributed.tensor import DTensor

    assert isinstance(p, DTensor), "an optimizer state sharded as its parameter"
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def holds_shards(model: nn.Module) -> bool:
    """``model``'s parameters are FSDP2's shards already (a rank joining a job holds the whole model it built)."""
    return any(is_dtensor(p) for p in model.parameters())
