"""Rank helpers that work without a process group, so training code has no ``if distributed:`` branches:
with no group, ``get_rank()`` is 0, ``all_reduce`` is the identity, ``all_gather_object(x)`` is ``[x]``.
(Named so it never shadows ``torch.distributed``, which is ``dist`` everywhere in this project.)"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized() and get_world_size() > 1:
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place allreduce (``sum``/``mean``/``max``/``min``) across the default group; identity when alone."""
    if is_initialized() and get_world_size() > 1:
        if op == "mean":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(get_world_size())
        else:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))
    return tensor


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Rank ``src``'s buffers (batch-norm statistics) on every rank."""
    if is_initialized() and get_world_size() > 1:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=src)


def all_gather_object(obj: object) -> list:
    """Every rank's ``obj``, in rank order (a one-element list when alone)."""
    if not (is_initialized() and get_world_size() > 1):
        return [obj]
    out: list = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank."""
    if not (is_initialized() and get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
