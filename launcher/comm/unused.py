"""Parameters that got no gradient in a synchronised backward pass.

Without ``find_unused_parameters`` they are an error that names them: every rank must reduce every bucket. With it,
as torch DDP does: each such parameter contributes the gradient it holds (the sum of ``no_sync`` micro-steps, an old
gradient never zeroed, or zeros), and a "used since the last synchronised backward" map (so a parameter used only in
``no_sync`` micro-steps is averaged), summed over ranks after the buckets, decides what it ends with: a parameter no
rank used keeps its ``.grad`` untouched, one used anywhere holds the reduced value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from launcher.comm.buckets import Bucket


class UnusedParameters:
    def __init__(self, names: dict[int, str], world_size: int) -> None:
        self.names = names  # id(param) -> name, for the error
        self.world_size = world_size
        self.used: set[int] = set()  # parameters given a gradient since the last synchronised backward

    def settle(self, buckets: Sequence[Bucket], allowed: bool) -> dict[int, object]:
        """A synchronised backward ends: the parameters its buckets still wait for got no gradient. An error naming
        them, or (``allowed``) each contributes what its ``.grad`` holds: id(param) -> what to restore if no rank
        used it."""
        unseen = [(b, i, p) for b in buckets if b.pending for i, p in enumerate(b.params) if id(p) not in b.seen]
        if unseen and not allowed:
            self._refuse([p for _, _, p in unseen])
        return {id(p): self.contribute(b, i, p) for b, i, p in unseen}

    def _refuse(self, unused: Sequence[nn.Parameter]) -> None:
        self.used.clear()
        names = sorted(self.names[id(p)] for p in unused)
        raise RuntimeError(
            f"parameters got no gradient in this backward pass: {', '.join(names)}; every rank must "
            "reduce every bucket. HINT: use them in forward, freeze them (requires_grad=False), or set "
            "comm.find_unused_parameters=true"
        )

    def contribute(self, bucket: Bucket, slot: int, p: nn.Parameter) -> object:
        """What ``p``'s ``.grad`` holds goes into its bucket, averaged (zeros if none). Returns what to restore if
        no rank used it."""
        grad = p.grad
        if bucket.sparse:
            if grad is None:  # a sparse allreduce needs a tensor: an empty one of the parameter's shape
                p.grad = torch.sparse_coo_tensor(
                    torch.empty(1, 0, dtype=torch.long, device=p.device),
                    torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device),
                    p.shape,
                )
            return grad
        view = bucket.views[slot]
        keep = grad.clone() if grad is not None and id(p) not in self.used else None
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():
            view.div_(self.world_size)
        else:
            torch.div(grad, self.world_size, out=view)
        p.grad = view
        return keep

    def start_map(self, buckets: Sequence[Bucket]) -> Future:
        """The used map, summed over ranks (flat, asynchronously), after the buckets: the default group must see
        one order of collectives on every rank."""
        params = [p for b in buckets for p in b.params]
        flags = torch.tensor([float(id(p) in self.used) for p in params], device=params[0].device)  # nccl: GPU
        return dist.all_reduce(flags, async_op=True).get_future()

    def apply_map(self, buckets: Sequence[Bucket], used: torch.Tensor, kept: dict[int, object]) -> None:
        """A parameter no rank used since the last synchronisation keeps the ``.grad`` it had (None, or the old
        gradient); one used anywhere holds the reduced value."""
        flags = iter(used.tolist())
        for bucket in buckets:
            for slot, p in enumerate(bucket.params):
                if next(flags) or id(p) not in kept:
                    continue
                old = kept[id(p)]
                if old is None or bucket.sparse:
                    p.grad = old  # type: ignore[assignment]
                else:
                    bucket.views[slot].copy_(old)  # type: ignore[arg-type]
                    p.grad = bucket.views[slot]
