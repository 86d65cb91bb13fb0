"""Rank helpers that work without a process group, so training code has no ``if distributed:`` branches:
with no group, ``get_rank()`` is 0, ``all_reduce`` is the identity, ``all_gather_object(x)`` is ``[x]``.
(Named so it never shadows ``torch.distributed``, which is ``dist`` everywhere in this project.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from launcher.group.abort import Abort, wait
from launcher.trust import signed
from launcher.trust.secret import Secret


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


def all_reduce(tensor: torch.Tensor, op: str = "sum", abort: Optional[Abort] = None) -> torch.Tensor:
    """In-place allreduce (``sum``/``mean``/``max``/``min``) across the default group; identity when alone."""
    if is_initialized() and get_world_size() > 1:
        reduce_op = dist.ReduceOp.SUM if op == "mean" else getattr(dist.ReduceOp, op.upper())
        wait(dist.all_reduce(tensor, op=reduce_op, async_op=True), abort)  # healing: PeerLost, not a hang
        if op == "mean":
            tensor.div_(get_world_size())
    return tensor


def broadcast_buffers(module: torch.nn.Module, src: int = 0, abort: Optional[Abort] = None) -> None:
    """Rank ``src``'s buffers (batch-norm statistics) on every rank."""
    if is_initialized() and get_world_size() > 1:
        for buffer in module.buffers():
            wait(dist.broadcast(buffer, src=src, async_op=True), abort)  # healing: PeerLost, not a hang


def all_gather_object(obj: object, abort: Optional[Abort] = None, secret: Optional[Secret] = None) -> list:
    """Every rank's ``obj``, in rank order (a one-element list when alone). With the job's ``secret`` (every job
    the launcher's head starts) the pickles are signed and a peer's is unpickled only if it verifies; with an
    ``abort`` signal, a lost machine cannot hold it up. With neither: torch's own."""
    return _gather_object(obj, None, abort, secret)  # type: ignore[return-value]


def gather_object(
    obj: object, dst: int = 0, abort: Optional[Abort] = None, secret: Optional[Secret] = None
) -> Optional[list]:
    """Every rank's ``obj`` on rank ``dst`` only (None on the others): what only it needs (a checkpoint's
    per-rank states) costs the others nothing to receive. Signed and abortable as ``all_gather_object``."""
    return _gather_object(obj, dst, abort, secret)


def _gather_object(obj: object, dst: Optional[int], abort: Optional[Abort], secret: Optional[Secret]) -> Optional[list]:
    """To every rank (``dst`` None) or to ``dst``."""
    if not (is_initialized() and get_world_size() > 1):
        return [obj]
    receives = dst is None or get_rank() == dst
    out: Optional[list] = [None] * get_world_size() if receives else None
    if abort is None and secret is None:
        if dst is None:
            dist.all_gather_object(out, obj)
        else:
            dist.gather_object(obj, out, dst=dst)
        return out
    at = _device()
    data = torch.frombuffer(bytearray(signed.dumps(obj, secret)), dtype=torch.uint8).to(at)
    sizes = [torch.zeros(1, dtype=torch.int64, device=at) for _ in range(get_world_size())]
    wait(dist.all_gather(sizes, torch.tensor([data.numel()], device=at), async_op=True), abort)
    longest = int(max(s.item() for s in sizes))
    padded = torch.nn.functional.pad(data, (0, longest - data.numel()))
    parts = [torch.empty(longest, dtype=torch.uint8, device=at) for _ in sizes] if receives else None
    if dst is None:
        wait(dist.all_gather(parts, padded, async_op=True), abort)
    else:
        wait(dist.gather(padded, parts, dst=dst, async_op=True), abort)
    if parts is None:
        return None
    return [
        signed.loads(part[: int(size.item())].cpu().numpy().tobytes(), secret, f"rank {rank}")
        for rank, (part, size) in enumerate(zip(parts, sizes))
    ]


def _device() -> torch.device:
    """Where the default group's collectives take their tensors: the current GPU under nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_object(
    obj: object, src: int = 0, abort: Optional[Abort] = None, secret: Optional[Secret] = None
) -> object:
    """Rank ``src``'s ``obj`` on every rank (signed and abortable as ``all_gather_object``)."""
    if not (is_initialized() and get_world_size() > 1):
        return obj
    if abort is None and secret is None:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    mine, at = get_rank() == src, _device()
    data = signed.dumps(obj, secret) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=at)
    wait(dist.broadcast(size, src=src, async_op=True), abort)
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(at)
        if mine
        else torch.empty(int(size.item()), dtype=torch.uint8, device=at)
    )
    wait(dist.broadcast(payload, src=src, async_op=True), abort)
    return obj if mine else signed.loads(payload.cpu().numpy().tobytes(), secret, f"rank {src}")


@dataclass(frozen=True)
class Peers:
    """The collectives above, bound to a rank's ``abort`` signal (healing in place) and the job's ``secret`` (every
    job the launcher's head starts): what training code holds and calls, so none of it forgets either."""

    abort: Optional[Abort] = None
    secret: Optional[Secret] = None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return all_reduce(tensor, op, self.abort)

    def broadcast_buffers(self, module: torch.nn.Module, src: int = 0) -> None:
        broadcast_buffers(module, src, self.abort)

    def all_gather_object(self, obj: object) -> list:
        return all_gather_object(obj, self.abort, self.secret)

    def gather_object(self, obj: object, dst: int = 0) -> Optional[list]:
        return gather_object(obj, dst, self.abort, self.secret)

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        return broadcast_object(obj, src, self.abort, self.secret)
