"""What the reducer is built from: the bucket plan and the buckets themselves (one flat buffer each, the
parameters' gradients as views into it). Parameters are bucketed in reverse registration order (roughly the order
backward produces gradients): a small first bucket (``first_bucket_mb``, ~1 MB) so communication starts early,
then ``bucket_cap_mb``. A sparse gradient (``nn.Embedding(sparse=True)``) has a bucket of its own, reduced by a
sparse allreduce over all ranks (flat), as DDP does: ``sparse_allreduce`` is a collective."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from launcher.comm.compress import Matrix
from launcher.comm.sizes import MB


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
    claimed: bool = False  # forward overlap: claimed by step(), this bucket's optimizer update is still to run
    matrices: list[Matrix] = field(default_factory=list)  # each view with its parameter's index (compress.py)


def build_buckets(
    model: nn.Module, params: list[nn.Parameter], first_bucket_mb: float, bucket_cap_mb: float
) -> tuple[list[Bucket], dict[int, tuple[int, int]]]:
    """The buckets over ``params`` (in reverse registration order) and where each parameter sits: id(param) ->
    (bucket, slot). A gradient already present is copied into its view, which becomes ``.grad``; else ``.grad``
    stays None until backward (as under DDP). A sparse parameter gets a bucket of its own, with no buffer."""
    sparse = sparse_parameters(model)
    plan = plan_buckets(
        [p.numel() * p.element_size() for p in params],
        [(p.dtype, p.device, id(p) if id(p) in sparse else None) for p in params],  # a sparse one's key is its own
        first_bucket_mb * MB,
        bucket_cap_mb * MB,
    )
    buckets: list[Bucket] = []
    where: dict[int, tuple[int, int]] = {}
    for index, members in enumerate(plan):
        ps = [params[i] for i in members]
        if id(ps[0]) in sparse:
            where[id(ps[0])] = (index, 0)
            buckets.append(Bucket(ps, [], torch.empty(0, dtype=ps[0].dtype), sparse=True))
            continue
        buffer = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        views: list[torch.Tensor] = []
        offset = 0
        for p in ps:
            view = buffer[offset : offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
                p.grad = view
            where[id(p)] = (index, len(views))
            views.append(view)
            offset += p.numel()
        keys = [len(params) - 1 - i for i in members]  # the index in registration order, the same on every rank
        buckets.append(Bucket(ps, views, buffer, matrices=[Matrix(v, k) for v, k in zip(views, keys)]))
    return buckets, where


def whole_parameter_chunks(bucket: Bucket, chunk_bytes: int) -> list[torch.Tensor]:
    """The bucket's buffer cut at parameter boundaries into pieces of about ``chunk_bytes`` (a larger parameter
    alone): PowerSGD compresses whole matrices only."""
    chunks: list[torch.Tensor] = []
    start = end = 0
    for view in bucket.views:
        if end > start and (end - start + view.numel()) * bucket.buffer.element_size() > chunk_bytes:
            chunks.append(bucket.buffer[start:end])
            start = end
        end += view.numel()
    if end > start:
        chunks.append(bucket.buffer[start:end])
    return chunks


def sparse_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters whose gradients are sparse (as DDP finds them: embeddings with ``sparse=True``)."""
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        for p in m.parameters(recurse=False)
    }


def sparse_allreduce(param: nn.Parameter, world_size: int, consume: bool = False) -> Future:
    """Average a sparse gradient over all ranks (gloo's sparse allreduce returns a new tensor). ``consume``: the
    parameter's ``.grad`` is None afterwards (the forward overlap's rule: the reduced one comes at its update)."""
    assert param.grad is not None
    grad = param.grad.coalesce() / world_size
    if consume:
        param.grad = None
    return dist.all_reduce(grad, async_op=True).get_future()
