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
  error, or reduced as they are with ``find_unused_parameters=True``.
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


class BucketedReducer:
    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        hierarchical: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        self.topology = topology
        self.hierarchical = hierarchical
        self.find_unused_parameters = find_unused_parameters
        self.world_size = topology.world_size
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # named_parameters dedupes ties
        self._names = {id(p): n for n, p in named}
        params = [p for _, p in reversed(named)]
        with torch.no_grad():  # everyone starts from rank 0's weights, as DDP does
            for p in params:
                if self.world_size > 1:
                    dist.broadcast(p.data, src=0)
        plan = plan_buckets(
            [p.numel() * p.element_size() for p in params],
            [(p.dtype, p.device) for p in params],
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
            buffer = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            views, offset = [], 0
            for p in ps:
                view = buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
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
        self.last_wait_s = 0.0
        self.launched = 0  # bucket allreduces started so far

    # ------------------------------------------------------------------ public
    def layout(self) -> list[tuple[int, float]]:
        """(parameters, MB) per bucket, in launch order."""
        return [(len(b.params), b.buffer.numel() * b.buffer.element_size() / MB) for b in self.buckets]

    def describe(self) -> str:
        sizes = ", ".join(f"{mb:.2f}" for _, mb in self.layout())
        return f"{len(self.buckets)} bucket(s) [{sizes}] MB, {'hierarchical' if self.hierarchical else 'flat'}"

    def close(self) -> None:
        """Remove the gradient hooks (the parameters train on without this reducer, e.g. under another one)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            if set_to_none:
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
    def _on_grad(self, param: nn.Parameter) -> None:
        index, slot = self._where[id(param)]
        bucket, view = self.buckets[index], self.buckets[index].views[slot]
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
        self._armed = False
        missing = [self._names[id(p)] for b in self.buckets if b.pending for p in b.params if id(p) not in b.seen]
        if missing:
            if not self.find_unused_parameters:
                raise RuntimeError(
                    f"parameters got no gradient in this backward pass: {', '.join(missing)}; every rank must "
                    "reduce every bucket. HINT: use them in forward, freeze them (requires_grad=False), or set "
                    "comm.find_unused_parameters=true"
                )
            for bucket in self.buckets:
                for p, view in zip(bucket.params, bucket.views):
                    if id(p) not in bucket.seen and (p.grad is None or p.grad.data_ptr() != view.data_ptr()):
                        view.zero_()  # no gradient this pass: contribute zeros, not last step's values
                        p.grad = view
                bucket.pending = 0
            self._launch_ready()
        start = time.perf_counter()
        with trace.span("wait for buckets", "step"):
            for bucket in self.buckets:
                if bucket.future is not None:
                    bucket.future.wait()
                bucket.future = None  # no reference to the backend's work outlives the step
        self.last_wait_s = time.perf_counter() - start


def _on_grad(reducer_ref: weakref.ref[BucketedReducer], param: nn.Parameter) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._on_grad(param)
