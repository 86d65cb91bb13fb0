"""Our gradient reducer: buckets whose allreduce overlaps the backward pass.

- Parameters are bucketed in reverse registration order (roughly the order backward produces gradients):
  a small first bucket (``first_bucket_mb``, ~1 MB) so communication starts early, then ``bucket_cap_mb``.
- Each bucket is one flat buffer and, once a gradient has arrived, ``param.grad`` is a view into it; the
  optimiser reads the reduced gradients there, nothing is copied back. ``zero_grad()`` sets ``.grad`` to None:
  autograd then hands over the gradient it computed (no add), and the hook divides it by the world size straight
  into the bucket (one read, one write per element). Measured (bench/reducer.py): zeroing the views and letting
  autograd add into them, then dividing the bucket, costs twice the memory passes and made steps slower;
  ``zero_grad(set_to_none=False)`` keeps that mode.
  Under ``no_sync()`` the views stay bound and autograd accumulates into them in place.
- A post-accumulate-grad hook counts a bucket's gradients; the moment it is complete it is divided by the world
  size and its allreduce (flat, or node-first) is launched asynchronously. Buckets launch strictly in index
  order, the same on every rank, whatever order their gradients arrive in.
- One wait, queued to run when backward finishes: ``loss.backward()`` returns with averaged gradients, ready for
  ``optimizer.step()``. The time spent in that wait is the exposed communication (``last_wait_s``).
- ``no_sync()`` accumulates locally (gradient accumulation); parameters that got no gradient are named in an
  error, or, with ``find_unused_parameters=True``, handled as torch DDP does: each rank contributes the gradient
  it holds (zeros if none), a "used since the last synchronised backward" map (so a parameter used only in
  ``no_sync`` micro-steps is averaged) is summed over ranks, and a parameter no rank used keeps its ``.grad``
  untouched.
- Construction, as DDP: every rank must have the same parameters and buffers (names, shapes, dtypes; the first
  difference is named), and rank 0's parameters (frozen ones too) and buffers are broadcast. Before a forward,
  rank 0's buffers are broadcast again (``broadcast_buffers``, DDP's rule: when the previous forward ran with
  gradients and synchronisation).
- Sparse gradients (``nn.Embedding(sparse=True)``): such a parameter has a bucket of its own, reduced by a sparse
  allreduce over all ranks (flat), as DDP does.
- A model whose parameters changed after the reducer was built (a layer added or replaced) is refused at its next
  forward: DDP would train the new parameters without reducing them, the ranks silently diverging.

The README's "Our reducer vs torch DDP" table lists each behaviour with its parity test.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from . import trace
from .collectives import start_allreduce
from .topology import Topology

MB = 1024 * 1024


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
class _Bucket:
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    buffer: torch.Tensor
    pending: int = 0
    future: Future | None = None
    seen: set = field(default_factory=set)
    sparse: bool = False  # one parameter with sparse gradients: reduced by a sparse allreduce, not in ``buffer``


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


class BucketedReducer:
    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        hierarchical: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        self.topology = topology
        self.hierarchical = hierarchical
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.world_size = topology.world_size
        self.model = model
        everything = list(model.named_parameters())  # named_parameters dedupes tied parameters
        self._all_ids = {id(p): n for n, p in everything}
        self._model_buffers = list(model.buffers())
        if self.world_size > 1:
            check_same_model(model)
            # everyone starts from rank 0's state, as DDP does: frozen parameters too, and buffers unless
            # broadcast_buffers=False (DDP's then stay each rank's own)
            with torch.no_grad():
                for tensor in [p for _, p in everything] + (self._model_buffers if broadcast_buffers else []):
                    dist.broadcast(tensor, src=0)
        named = [(n, p) for n, p in everything if p.requires_grad]
        self._names = {id(p): n for n, p in named}
        params = [p for _, p in reversed(named)]
        sparse = sparse_parameters(model)
        plan = plan_buckets(
            [p.numel() * p.element_size() for p in params],
            # a sparse parameter's key is its own: it gets a bucket alone
            [(p.dtype, p.device, id(p) if id(p) in sparse else None) for p in params],
            first_bucket_mb * MB,
            bucket_cap_mb * MB,
        )
        self.buckets: list[_Bucket] = []
        # The parameters' hooks reach the reducer through a weak reference: a hook held in C++ autograd state
        # is invisible to Python's garbage collector, and a strong one would keep the reducer, its topology and
        # so the process groups (with their gloo threads) alive until interpreter exit, where those threads
        # crash the process (std::terminate) while it shuts down.
        me = weakref.ref(self)
        self._hooks: list = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, slot)
        for index, members in enumerate(plan):
            ps = [params[i] for i in members]
            if id(ps[0]) in sparse:
                self._where[id(ps[0])] = (index, 0)
                self._hooks.append(ps[0].register_post_accumulate_grad_hook(functools.partial(_on_grad, me)))
                self.buckets.append(_Bucket(ps, [], torch.empty(0, dtype=ps[0].dtype), sparse=True))
                continue
            buffer = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            views, offset = [], 0
            for p in ps:
                view = buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:  # else .grad stays None until backward (as under DDP)
                    view.copy_(p.grad)
                    p.grad = view
                views.append(view)
                offset += p.numel()
                self._where[id(p)] = (index, len(views) - 1)
                self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(_on_grad, me)))
            self.buckets.append(_Bucket(ps, views, buffer))
        self._sync = True
        self._armed = False
        self._next = 0
        self._used: set[int] = set()  # parameters given a gradient since the last synchronised backward
        self._sync_buffers = True  # DDP's require_forward_param_sync
        self.last_wait_s = 0.0
        self.launched = 0  # bucket allreduces started so far
        self._hooks.append(model.register_forward_pre_hook(functools.partial(_before_forward, me)))
        self._hooks.append(model.register_forward_hook(functools.partial(_after_forward, me)))

    # ------------------------------------------------------------------ public
    def layout(self) -> list[tuple[int, float]]:
        """(parameters, MB) per bucket, in launch order."""
        return [(len(b.params), b.buffer.numel() * b.buffer.element_size() / MB) for b in self.buckets]

    def describe(self) -> str:
        sizes = ", ".join(f"{mb:.2f}" for _, mb in self.layout())
        return f"{len(self.buckets)} bucket(s) [{sizes}] MB, {'hierarchical' if self.hierarchical else 'flat'}"

    def close(self) -> None:
        """Remove the gradient and forward hooks (the model trains on without this reducer, e.g. under another)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            if set_to_none or bucket.sparse:
                for p in bucket.params:
                    p.grad = None
            else:
                bucket.buffer.zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ------------------------------------------------------------------ hooks
    def _before_forward(self) -> None:
        now = {id(p): n for n, p in self.model.named_parameters()}
        if now.keys() != self._all_ids.keys():
            new = [n for i, n in now.items() if i not in self._all_ids]
            gone = [n for i, n in self._all_ids.items() if i not in now]
            raise RuntimeError(
                f"the model's parameters changed after the reducer was built (new: {', '.join(new) or '-'}; gone: "
                f"{', '.join(gone) or '-'}): their gradients would not be reduced; HINT: finish building the model "
                "(or load its final form) before creating the reducer, or create a new reducer after the change"
            )
        if self.broadcast_buffers and self._sync_buffers and self._model_buffers and self.world_size > 1:
            with torch.no_grad():
                for buffer in self._model_buffers:
                    dist.broadcast(buffer, src=0)

    def _after_forward(self) -> None:
        # DDP's rule: the next forward broadcasts buffers when this one ran with gradients, synchronised
        self._sync_buffers = torch.is_grad_enabled() and self._sync

    def _on_grad(self, param: nn.Parameter) -> None:
        index, slot = self._where[id(param)]
        bucket = self.buckets[index]
        if param.grad is not None:
            self._used.add(id(param))
        if bucket.sparse:
            self._on_sparse_grad(bucket, param)
            return
        view = bucket.views[slot]
        grad = param.grad
        fresh = grad is not None and grad.data_ptr() != view.data_ptr()
        if not self._sync:
            if grad is not None and fresh:  # first micro-step after zero_grad: into the bucket; later ones add in place
                view.copy_(grad)
                param.grad = view
            return
        if not self._armed:
            self._arm()
        if id(param) in bucket.seen:
            return  # one count per parameter per backward pass
        # average: divide before the sum (no overflow in low precision), fused with the copy into the bucket
        if grad is not None and fresh:
            torch.div(grad, self.world_size, out=view)
            param.grad = view
        else:
            view.div_(self.world_size)
        bucket.seen.add(id(param))
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _on_sparse_grad(self, bucket: _Bucket, param: nn.Parameter) -> None:
        if not self._sync:
            return  # autograd accumulates the sparse gradients in .grad
        if not self._armed:
            self._arm()
        if id(param) in bucket.seen:
            return
        bucket.seen.add(id(param))
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _arm(self) -> None:
        self._armed = True
        self._next = 0
        for bucket in self.buckets:
            bucket.pending, bucket.future = len(bucket.params), None
            bucket.seen.clear()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            bucket = self.buckets[self._next]
            if bucket.sparse:
                bucket.future = _sparse_allreduce(bucket.params[0], self.world_size)
            else:
                bucket.future = start_allreduce(bucket.buffer, self.topology, self.hierarchical)
            if (tracer := trace.active()) is not None:  # comm.trace: the bucket's allreduce on the timeline
                name, start = f"bucket {self._next}", time.perf_counter_ns()
                mb = round(bucket.buffer.numel() * bucket.buffer.element_size() / MB, 3)

                def done(_: object, n: str = name, t: int = start, m: float = mb, rec=tracer.record) -> None:
                    rec(n, "buckets", t, time.perf_counter_ns(), mb=m)

                bucket.future.then(done)
            self._next += 1
            self.launched += 1

    def _finalize(self) -> None:
        """Queued to run when autograd's work for this backward ends: its trace span starts at that moment."""
        with trace.span("wait for buckets", "step"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        self._armed = False
        unseen = [(b, i, p) for b in self.buckets if b.pending for i, p in enumerate(b.params) if id(p) not in b.seen]
        if unseen and not self.find_unused_parameters:
            self._used.clear()
            names = sorted(self._names[id(p)] for _, _, p in unseen)
            raise RuntimeError(
                f"parameters got no gradient in this backward pass: {', '.join(names)}; every rank must "
                "reduce every bucket. HINT: use them in forward, freeze them (requires_grad=False), or set "
                "comm.find_unused_parameters=true"
            )
        kept = {id(p): self._contribute_unused(b, i, p) for b, i, p in unseen}
        for bucket in self.buckets:
            bucket.pending = 0
        self._launch_ready()
        # after the buckets: on a rank whose unused parameter held a bucket back, that bucket was launched just
        # now, on another during backward; the default group must see one order on every rank
        used = self._start_used_map() if self.find_unused_parameters else None
        start = time.perf_counter()
        for bucket in self.buckets:
            if bucket.future is not None:
                result = bucket.future.wait()
                if bucket.sparse:
                    bucket.params[0].grad = result[0]
            bucket.future = None  # no reference to the backend's work outlives the step
        if used is not None:
            self._apply_used_map(used.wait()[0], kept)
        self._used.clear()
        self.last_wait_s = time.perf_counter() - start

    def _contribute_unused(self, bucket: _Bucket, slot: int, p: nn.Parameter) -> object:
        """A parameter without a gradient in this synchronised pass contributes what its ``.grad`` holds (the
        sum of ``no_sync`` micro-steps, or an old gradient never zeroed; zeros if none), as DDP's do. Returns what
        to restore if no rank used it (DDP keeps such a ``.grad`` untouched)."""
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
        keep = grad.clone() if grad is not None and id(p) not in self._used else None
        if grad is None:
            view.zero_()
        elif grad.data_ptr() == view.data_ptr():
            view.div_(self.world_size)
        else:
            torch.div(grad, self.world_size, out=view)
        p.grad = view
        return keep

    def _start_used_map(self) -> Future:
        """The "used since the last synchronised backward" map, summed over ranks (flat, asynchronously)."""
        params = [p for b in self.buckets for p in b.params]
        flags = torch.tensor([float(id(p) in self._used) for p in params], device=params[0].device)  # nccl: GPU
        return dist.all_reduce(flags, async_op=True).get_future()

    def _apply_used_map(self, used: torch.Tensor, kept: dict[int, object]) -> None:
        """A parameter no rank used since the last synchronisation keeps the ``.grad`` it had (None, or the old
        gradient); one used anywhere holds the reduced value."""
        flags = iter(used.tolist())
        for bucket in self.buckets:
            for slot, p in enumerate(bucket.params):
                if next(flags) or id(p) not in kept:
                    continue
                old = kept[id(p)]
                if old is None or bucket.sparse:
                    p.grad = old  # type: ignore[assignment]
                else:
                    bucket.views[slot].copy_(old)  # type: ignore[arg-type]
                    p.grad = bucket.views[slot]


def _sparse_allreduce(param: nn.Parameter, world_size: int) -> Future:
    """Average a sparse gradient over all ranks (gloo's sparse allreduce returns a new tensor)."""
    assert param.grad is not None
    grad = param.grad.coalesce() / world_size
    return dist.all_reduce(grad, async_op=True).get_future()


def _before_forward(reducer_ref: weakref.ref[BucketedReducer], module: nn.Module, args: object) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._before_forward()


def _after_forward(reducer_ref: weakref.ref[BucketedReducer], module: nn.Module, args: object, out: object) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._after_forward()


def _on_grad(reducer_ref: weakref.ref[BucketedReducer], param: nn.Parameter) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._on_grad(param)
