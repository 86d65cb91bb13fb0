"""Rank helpers that work without a process group, so training code has no ``if distributed:`` branches:
with no group, ``get_rank()`` is 0, ``all_reduce`` is the identity, ``all_gather_object(x)`` is ``[x]``.
(Named so it never shadows ``torch.distributed``, which is ``dist`` everywhere in this project.)"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from . import abandon


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
        reduce_op = dist.ReduceOp.SUM if op == "mean" else getattr(dist.ReduceOp, op.upper())
        abandon.wait(dist.all_reduce(tensor, op=reduce_op, async_op=True))  # healing: PeerLost, not a hang
        if op == "mean":
            tensor.div_(get_world_size())
    return tensor


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Rank ``src``'s buffers (batch-norm statistics) on every rank."""
    if is_initialized() and get_world_size() > 1:
        for buffer in module.buffers():
            abandon.wait(dist.broadcast(buffer, src=src, async_op=True))  # healing: PeerLost, not a hang


def all_gather_object(obj: object) -> list:
    """Every rank's ``obj``, in rank order (a one-element list when alone)."""
    if not (is_initialized() and get_world_size() > 1):
        return [obj]
    out: list = [None] * get_world_size()
    if not abandon.enabled():
        dist.all_gather_object(out, obj)
        return out
    # healing in place (gloo, CPU): the same, from two collectives that a lost machine cannot hold up
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in out]
    abandon.wait(dist.all_gather(sizes, torch.tensor([data.numel()]), async_op=True))
    longest = int(max(s.item() for s in sizes))
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in out]
    abandon.wait(dist.all_gather(parts, torch.nn.functional.pad(data, (0, longest - data.numel())), async_op=True))
    return [pickle.loads(part[: int(size.item())].numpy().tobytes()) for part, size in zip(parts, sizes)]


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank."""
    if not (is_initialized() and get_world_size() > 1):
        return obj
    if not abandon.enabled():
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    # healing in place (gloo, CPU): its size, then its bytes, in two collectives a lost machine cannot hold up
    mine = get_rank() == src
    data = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    abandon.wait(dist.broadcast(size, src=src, async_op=True))
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8) if mine else torch.empty(int(size), dtype=torch.uint8)
    )
    abandon.wait(dist.broadcast(payload, src=src, async_op=True))
    return obj if mine else pickle.loads(payload.numpy().tobytes())
