"""What the reducer is built from: the bucket plan, a bucket's state, the checks every rank's model must pass,
and which optimizers can update a bucket on its own (the forward overlap). ``check_same_model`` and
``sparse_allreduce`` are collectives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

MB = 1024 * 1024

# optimizers whose step updates each parameter from its own gradient and state only: a step over a subset of the
# parameters is exactly the full step restricted to that subset
PER_PARAMETER_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)


def forward_overlap_refusal(optimizer: torch.optim.Optimizer | None, find_unused_parameters: bool) -> str | None:
    """Why the forward overlap cannot run with these settings, or None when it can."""
    if optimizer is None:
        return "no optimizer handed to the reducer (backward returns with averaged gradients)"
    if find_unused_parameters:
        return "find_unused_parameters: the used-parameters map comes after every bucket"
    if type(optimizer) not in PER_PARAMETER_OPTIMIZERS:
        return f"{type(optimizer).__name__} is not known to update each parameter on its own"
    return None


def plan_buckets(
    sizes_bytes: Sequence[int], keys: Sequence[object], first_cap_bytes: float, cap_bytes: float
) -> list[list[int]]:
    """Group consecutive items (already in reverse registration order) into buckets: a bucket closes once it
    holds at least its cap (``first_cap_bytes`` for the first, ``cap_bytes`` after), as torch DDP's do, so a
    layer's bias and weight travel together; an item never splits, a new ``key`` (dtype, device) starts a new
    bucket. Returns lists of item indices."""
    buckets: list[list[int]] = []
    filled, cap, open_ = 0.0, first_cap_bytes, False
    for i, (size, key) in enumerate(zip(sizes_bytes, keys)):
        if open_ and keys[buckets[-1][0]] != key:
            open_ = False
        if not open_:
            if buckets:
                cap = cap_bytes
            buckets.append([])
            filled, open_ = 0.0, True
        buckets[-1].append(i)
        filled += size
        if filled >= cap:
            open_ = False
    return buckets


@dataclass
class Bucket:
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    buffer: torch.Tensor
    pending: int = 0
    futures: list[Future] = field(default_factory=list)  # the allreduces in flight (one per chunk)
    seen: set = field(default_factory=set)
    sparse: bool = False  # one parameter with sparse gradients: reduced by a sparse allreduce, not in ``buffer``
    chunks: list[torch.Tensor] = field(default_factory=list)  # forward overlap: the buffer in ~chunk_mb pieces
    update: bool = False  # forward overlap: step() was called, this bucket's optimizer update is still to run


def sparse_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters whose gradients are sparse (as DDP finds them: embeddings with ``sparse=True``)."""
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }


def check_same_model(model: nn.Module) -> None:
    """Every rank must hold the same parameters and buffers, in one order: name the first difference."""
    mine = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    mine += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        for i in range(max(len(theirs), len(everyone[0]))):
            ours = everyone[0][i] if i < len(everyone[0]) else None
            other = theirs[i] if i < len(theirs) else None
            if ours != other:
                show = lambda e: f"{e[0]} {e[1]!r} {list(e[2])} {e[3]}" if e else "nothing"  # noqa: E731
                raise ValueError(
                    f"rank {rank}'s model differs from rank 0's at entry {i}: {show(other)} there, {show(ours)} on "
                    "rank 0; HINT: build the same model on every rank (the same code and config) before the reducer"
                )


def sparse_allreduce(param: nn.Parameter, world_size: int) -> Future:
    """Average a sparse gradient over all ranks (gloo's sparse allreduce returns a new tensor)."""
    assert param.grad is not None
    grad = param.grad.coalesce() / world_size
    return dist.all_reduce(grad, async_op=True).get_future()
