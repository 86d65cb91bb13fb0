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

Forward overlap (``optimizer=`` given; ``overlap="forward"``, the default then): ``loss.backward()`` returns
without waiting; ``reducer.step()`` replaces ``optimizer.step()`` and updates each bucket's parameters the moment
its allreduce has completed: at once for buckets already done, else just before the first module that holds them
runs its next forward (a forward pre-hook per module; the model's own forward post-hook applies whatever is left).
The tail of communication then hides behind the optimizer and the next forward. Buckets travel in chunks
(``chunk_mb``) through a scheduler that sends the chunk the next forward needs soonest first (the first layers'
buckets, which backward produces last); at each bucket event it sends what a model of the link (one queue drained
at the link's rate) would carry by the next event, so that later, more urgent chunks find a short queue. Every
rank derives that model from the same measurement (the first ``WARMUP_STEPS`` synchronised passes run as in the
backward mode, their event times and link rate agreed by one allreduce), so every rank launches the same chunks in
the same order. When the first layer is an ``nn.Linear``, its weight gradient is computed in row blocks and each
chunk leaves as soon as its rows exist, overtaking the second layer's chunks (tail.py). Each update is one
``optimizer.step()`` over that bucket's parameters with the hyperparameters (learning rate...) recorded when
``step()`` was called: the same step as one optimizer over all parameters, for optimizers
that update each parameter on its own (``PER_PARAMETER_OPTIMIZERS``). Gradients belong to the reducer from
backward to their update, which consumes them: ``.grad`` is None meanwhile and after, as after ``zero_grad()``.
``flush()`` applies everything (before evaluation, checkpoints, the end). A parameter must be read by the module
that holds it (or after it): one read earlier in the forward would see its old value, which autograd then reports
as a tensor "modified by an inplace operation" in backward (``overlap="backward"`` is the fix).

The README's "Our reducer vs torch DDP" table lists each behaviour with its parity test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from . import trace
from .buckets import (
    MB,
    Bucket,
    check_same_model,
    forward_overlap_refusal,
    plan_buckets,
    sparse_allreduce,
    sparse_parameters,
)
from .collectives import start_allreduce
from .schedule import Schedule
from .tail import TailLinear, tail_linear
from .topology import Topology

OVERLAPS = ("forward", "backward")
WARMUP_STEPS = 3  # synchronised passes run as in the backward mode before the forward overlap; all but the first
#                  (new connections, cold caches: measured 4x slower) are timed for the scheduler's model of the link


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
        optimizer: torch.optim.Optimizer | None = None,
        overlap: str | None = None,
        chunk_mb: float = 1.0,
    ) -> None:
        """``overlap``: None = "forward" where the settings allow it (else "backward", why in
        ``overlap_reason``); "forward" asked for where they do not is a ValueError."""
        if overlap not in (None, *OVERLAPS):
            raise ValueError(f"overlap={overlap!r}; HINT: 'forward', 'backward' or None (forward where possible)")
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb={chunk_mb} must be > 0")
        refusal = forward_overlap_refusal(optimizer, find_unused_parameters)
        if overlap == "forward" and refusal is not None:
            raise ValueError(
                f"overlap='forward' cannot run here: {refusal}; HINT: pass the optimizer (SGD, AdamW, ...) as "
                "BucketedReducer(..., optimizer=opt), or use overlap='backward'"
            )
        self.optimizer = optimizer
        self.overlap = overlap or ("backward" if refusal else "forward")
        self.overlap_reason = refusal if self.overlap == "backward" and overlap is None else None
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
        self.buckets: list[Bucket] = []
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
                self.buckets.append(Bucket(ps, [], torch.empty(0, dtype=ps[0].dtype), sparse=True))
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
            self.buckets.append(Bucket(ps, views, buffer))
        forward = self.overlap == "forward"
        for bucket in self.buckets:
            if forward and not bucket.sparse:
                per_chunk = max(1, int(chunk_mb * MB) // bucket.buffer.element_size())
                bucket.chunks = list(bucket.buffer.split(per_chunk))
        self._sync = True
        self._armed = False
        self._next = 0
        self._used: set[int] = set()  # parameters given a gradient since the last synchronised backward
        self._sync_buffers = True  # DDP's require_forward_param_sync
        self.last_wait_s = 0.0
        self.launched = 0  # bucket allreduces started so far
        self._hooks.append(model.register_forward_pre_hook(functools.partial(_before_forward, me)))
        self._hooks.append(model.register_forward_hook(functools.partial(_after_forward, me)))
        # forward overlap
        self._pool: list[tuple[int, int]] = []  # (bucket, chunk) ready to send, the next forward's needs first
        self._schedule: Schedule | None = None  # agreed after warm-up: when chunks may be launched (schedule.py)
        self._link_free = 0.0  # this pass, in the schedule's model: when the link has carried all launched chunks
        self._events: list[float] = []  # warm-up: each bucket event's time, then the end of its allreduces
        self._timed: list[list[float]] = []  # warm-up: per timed pass, seconds from the first event to each, the end
        self._synced = 0  # synchronised backward passes so far
        self._unclaimed = False  # buckets in flight that no step() has claimed yet
        self._hparams: list[dict] = []  # each param group's hyperparameters when step() was called
        self._waited = 0.0  # seconds waited for buckets since the last step()
        self._tail: TailLinear | None = None  # the first layer's weight gradient sent in row blocks (tail.py)
        self._tail_sent = 0  # chunks of the last bucket sent before its gradients were complete, this pass
        self._early: set[int] = set()  # the tail layer's parameters whose gradients went that way this pass
        self.early_chunks = 0  # all passes so far
        if forward:
            last = self.buckets[-1] if self.buckets else None
            layer = tail_linear(model, last.params) if last is not None and not last.sparse else None
            if layer is not None:
                self._tail = TailLinear(me, layer, int(chunk_mb * MB))
            for module in model.modules():  # each module waits for the buckets that hold its own parameters
                mine = {self._where[id(q)][0] for q in module.parameters(recurse=False) if id(q) in self._where}
                if mine:
                    hook = functools.partial(_before_module, me, tuple(sorted(mine)))
                    self._hooks.append(module.register_forward_pre_hook(hook))

    # ------------------------------------------------------------------ public
    def layout(self) -> list[tuple[int, float]]:
        """(parameters, MB) per bucket, in launch order."""
        return [(len(b.params), b.buffer.numel() * b.buffer.element_size() / MB) for b in self.buckets]

    def describe(self) -> str:
        sizes = ", ".join(f"{mb:.2f}" for _, mb in self.layout())
        overlap = f"{self.overlap} overlap" + (f" ({self.overlap_reason})" if self.overlap_reason else "")
        if self._tail is not None:
            overlap += f", {self._names[id(self._tail.module.weight)]}'s gradient sent as its rows are computed"
        return (
            f"{len(self.buckets)} bucket(s) [{sizes}] MB, {'hierarchical' if self.hierarchical else 'flat'}, {overlap}"
        )

    def step(self) -> None:
        """The optimizer step, in place of ``optimizer.step()``. Forward overlap: the buckets whose allreduce has
        completed are updated now, the others just before their modules' next forward (or at ``flush()``), each
        with the hyperparameters of this call (an LR scheduler may step right after)."""
        if self.optimizer is None:
            raise RuntimeError("step() needs the optimizer: BucketedReducer(..., optimizer=opt); else optimizer.step()")
        if not self._unclaimed:  # backward overlap, a warm-up pass, or gradients already waited for
            self.optimizer.step()
            return
        self._unclaimed = False
        self._hparams = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]
        claimed = [i for i, b in enumerate(self.buckets) if b.futures]
        for i in claimed:
            self.buckets[i].update = True
        self._apply([i for i in claimed if all(f.done() for f in self.buckets[i].futures)])
        self.last_wait_s, self._waited = self._waited, 0.0

    def flush(self) -> None:
        """Every bucket reduced and every pending update applied: before anything that reads all parameters or
        gradients at once (evaluation elsewhere, a checkpoint, gradient clipping, the end of training)."""
        if self._unclaimed:
            self._keep_unclaimed()
        self._complete([i for i, b in enumerate(self.buckets) if b.update])

    def close(self) -> None:
        """Remove the gradient and forward hooks (the model trains on without this reducer, e.g. under another).
        Updates still pending under the forward overlap are dropped: ``flush()`` first to keep them."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._tail is not None:
            self._tail.remove()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            if bucket.update or bucket.futures:  # forward overlap: the reducer's until applied (.grad is None)
                continue
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
        if self._unclaimed:  # a backward not followed by step(): its gradients are kept, as without overlap
            self._keep_unclaimed()
        if self.broadcast_buffers and self._sync_buffers and self._model_buffers and self.world_size > 1:
            with torch.no_grad():
                for buffer in self._model_buffers:
                    dist.broadcast(buffer, src=0)

    def _after_forward(self) -> None:
        # DDP's rule: the next forward broadcasts buffers when this one ran with gradients, synchronised
        self._sync_buffers = torch.is_grad_enabled() and self._sync
        self._complete([i for i, b in enumerate(self.buckets) if b.update])  # parameters no module claimed

    def _before_module(self, indices: tuple[int, ...]) -> None:
        self._complete([i for i in indices if self.buckets[i].update])

    def _on_grad(self, param: nn.Parameter) -> None:
        if id(param) in self._early:  # its gradient went to the bucket row block by row block (tail.py)
            if param.grad is not None:
                self._untail(param, param.grad)
            return
        index, slot = self._where[id(param)]
        bucket = self.buckets[index]
        if bucket.update:  # a backward without a forward since step(): the update first (it consumes the old)
            fresh_grad = param.grad
            self._complete([index])
            param.grad = fresh_grad
        elif self._unclaimed:  # a second backward without step(): the first one's gradients accumulate
            fresh_grad = param.grad
            self._keep_unclaimed()
            if fresh_grad is not None and not bucket.sparse:
                bucket.views[slot].add_(fresh_grad)
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
        if self._scheduled:  # forward overlap: the gradient is the reducer's until its update
            param.grad = None
        bucket.seen.add(id(param))
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _on_sparse_grad(self, bucket: Bucket, param: nn.Parameter) -> None:
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
        self._link_free = 0.0
        self._tail_sent = 0
        self._events = []
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.seen.clear()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    @property
    def _scheduled(self) -> bool:
        """This pass sends chunks by priority and returns without waiting (forward overlap, after warm-up)."""
        return self.overlap == "forward" and self._synced >= WARMUP_STEPS

    def _launch_ready(self) -> None:
        """Bucket events, strictly in index order (the same sequence on every rank)."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            index, bucket = self._next, self.buckets[self._next]
            self._next += 1
            self.launched += 1
            if self.overlap == "backward" or bucket.sparse:
                self._launch(index, bucket.buffer, sparse=bucket.sparse)
                continue
            self._events.append(time.perf_counter())  # one per dense bucket: the schedule's index
            # this bucket holds earlier layers than any already ready: the next forward needs it first
            sent = self._tail_sent if index == len(self.buckets) - 1 else 0
            self._pool[:0] = [(index, c) for c in range(sent, len(bucket.chunks))]
            schedule, tail = self._schedule, self._tail
            if self._scheduled and schedule is not None:
                expected = tail is not None and len(tail.live) == 1  # the tail will send early (tail.py)
                self._pump(*schedule.at_event(len(self._events) - 1, expected))
            else:
                self._pump(0.0, math.inf)

    def _pump(self, now: float, until: float) -> None:
        """Send pooled chunks, most urgent first, while the schedule's link would have carried them by ``until``
        (plus its slack). Depends only on agreed numbers: every rank sends the same chunks in the same order."""
        schedule = self._schedule
        while self._pool:
            index, c = self._pool[0]
            chunk = self.buckets[index].chunks[c]
            if schedule is not None and not schedule.fits(self._link_free, now, until, _nbytes(chunk)):
                break
            self._pool.pop(0)
            self._send(index, c, now)

    def _send(self, index: int, c: int, now: float) -> None:
        chunk = self.buckets[index].chunks[c]
        if self._schedule is not None:
            self._link_free = self._schedule.carried(self._link_free, now, _nbytes(chunk))
        self._launch(index, chunk, chunk=c)

    def _tail_start(self, bias_grad: torch.Tensor | None) -> torch.Tensor | None:
        """The tail layer's backward begins (tail.py). In a synchronised scheduled pass where every earlier bucket
        has had its event and every other gradient of the last bucket is in, its weight's gradient is computed
        into the bucket and sent by chunks as its rows come: returns the weight's view (None: the plain path)."""
        if not (self._sync and self._scheduled and self._tail is not None):
            return None
        if not self._armed:
            self._arm()
        index = len(self.buckets) - 1
        bucket = self.buckets[index]
        layer = self._tail.module
        mine = [p for p in (layer.weight, layer.bias) if p is not None and id(p) in self._where]
        if self._next != index or bucket.update or self._unclaimed or bucket.pending != len(mine):
            return None
        if layer.bias is not None and id(layer.bias) in self._where:
            assert bias_grad is not None
            torch.div(bias_grad, self.world_size, out=bucket.views[self._where[id(layer.bias)][1]])
        self._early = {id(p) for p in mine}
        return bucket.views[self._where[id(layer.weight)][1]]

    def _tail_rows(self, rows: int, block: torch.Tensor) -> None:
        """The tail weight's gradient rows up to ``rows`` are computed (``block`` the last of them, not yet
        averaged): send every chunk of the last bucket they complete."""
        block.div_(self.world_size)
        index = len(self.buckets) - 1
        bucket = self.buckets[index]
        weight = bucket.views[-1]  # the tail's weight: the bucket's end
        done = weight.data_ptr() + rows * weight.stride(0) * weight.element_size()  # the bucket is filled below
        schedule, sent = self._schedule, self._tail_sent
        times = schedule.tail if schedule is not None and schedule.tail else [0.0] * len(bucket.chunks)
        while self._tail_sent < len(bucket.chunks):
            chunk = bucket.chunks[self._tail_sent]
            if chunk.data_ptr() + _nbytes(chunk) > done:
                break
            self._send(index, self._tail_sent, times[self._tail_sent])
            self._tail_sent += 1
            self.early_chunks += 1
        if sent < self._tail_sent and schedule is not None and schedule.tail:  # then what fits until the next
            self._pump(*schedule.after_tail_chunk(self._tail_sent - 1))

    def _untail(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """The tail layer's ``param`` got a gradient from outside its module too (read in a parent's forward, say),
        after its chunks left: once they are reduced, that part is reduced alone and added, the same on every
        rank (the same model); later passes take the plain path."""
        index, slot = self._where[id(param)]
        extra = grad / self.world_size
        param.grad = None
        for future in self.buckets[index].futures:  # kept: step() claims the bucket by them
            future.wait()
        start_allreduce(extra, self.topology, self.hierarchical).wait()
        self.buckets[index].views[slot].add_(extra)
        if self._tail is not None:
            warnings.warn(
                f"{self._names[id(param)]} is read outside its module too: its gradient is no longer sent as its "
                "rows are computed (the forward overlap goes on without that); HINT: read a layer's parameters "
                "only in its own forward to keep it",
                stacklevel=2,
            )
            self._tail.remove()
            self._tail = None
            if self._schedule is not None:
                self._schedule = dataclasses.replace(self._schedule, tail=None)

    def _tail_end(self) -> None:
        """The tail weight's gradient is complete: the last bucket's event sends what is left."""
        bucket = self.buckets[-1]
        bucket.seen |= self._early
        bucket.pending -= len(self._early)
        self._launch_ready()

    def _launch(self, index: int, tensor: torch.Tensor, sparse: bool = False, chunk: int | None = None) -> None:
        bucket = self.buckets[index]
        if sparse:
            future = sparse_allreduce(bucket.params[0], self.world_size)
        else:
            future = start_allreduce(tensor, self.topology, self.hierarchical)
        bucket.futures.append(future)
        if (tracer := trace.active()) is not None:  # comm.trace: the allreduce on the timeline
            start = time.perf_counter_ns()
            extra = {} if chunk is None else {"chunk": chunk}
            mb = round(tensor.numel() * tensor.element_size() / MB, 3)

            def done(_: object, n: str = f"bucket {index}", t: int = start, rec=tracer.record) -> None:
                rec(n, "buckets", t, time.perf_counter_ns(), mb=mb, **extra)

            future.then(done)

    def _finalize(self) -> None:
        """Queued to run when autograd's work for this backward ends: its trace span starts at that moment."""
        with trace.span("wait for buckets", "step"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        self._armed = False
        self._early = set()
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
        self._pump(0.0, math.inf)  # whatever is still pooled (the last bucket may have been a sparse one)
        # after the buckets: on a rank whose unused parameter held a bucket back, that bucket was launched just
        # now, on another during backward; the default group must see one order on every rank
        used = self._start_used_map() if self.find_unused_parameters else None
        scheduled = self._scheduled
        self._synced += 1
        if scheduled:  # forward overlap: step() and the next forward wait, bucket by bucket
            self._unclaimed = True
            self.last_wait_s = 0.0
            return
        start = time.perf_counter()
        self._wait(range(len(self.buckets)))
        if used is not None:
            self._apply_used_map(used.wait()[0], kept)
        self._used.clear()
        self.last_wait_s = time.perf_counter() - start
        self._waited = 0.0
        if self.overlap == "forward" and self._events and 1 < self._synced <= WARMUP_STEPS:
            self._events.append(time.perf_counter())
            self._timed.append([t - self._events[0] for t in self._events[1:]])
            if self._synced == WARMUP_STEPS:
                dense = [b for b in self.buckets if not b.sparse]
                shares = None
                if self._tail is not None:
                    last = self.buckets[-1]
                    shares = self._tail.chunk_shares(last.views[-1], last.chunks)  # its weight is the bucket's end
                self._schedule = Schedule.agree(
                    self._timed,
                    [sum(_nbytes(c) for c in b.chunks) for b in dense],
                    max(_nbytes(c) for b in dense for c in b.chunks),
                    shares,
                    self.world_size,
                )
                self._timed = []

    def _wait(self, indices: Sequence[int] | range) -> None:
        """Wait for these buckets' allreduces (gradients averaged in place; sparse ones bound to ``.grad``)."""
        start = time.perf_counter()
        for index in indices:
            bucket = self.buckets[index]
            if not bucket.futures:
                continue
            with trace.span(f"await bucket {index}", "step") if self._scheduled else contextlib.nullcontext():
                for future in bucket.futures:
                    result = future.wait()
            if bucket.sparse:
                bucket.params[0].grad = result[0]
            bucket.futures = []  # no reference to the backend's work outlives the step
        self._waited += time.perf_counter() - start

    def _complete(self, indices: Sequence[int]) -> None:
        """Forward overlap: wait for these buckets, then run their optimizer update."""
        if indices:
            self._wait(indices)
            self._apply(indices)

    def _keep_unclaimed(self) -> None:
        """Buckets in flight that no step() claimed: wait, and leave their averaged gradients in ``.grad``."""
        waiting = [i for i, b in enumerate(self.buckets) if b.futures]
        self._wait(waiting)
        self._bind_grads(waiting)
        self._unclaimed = False

    def _bind_grads(self, indices: Sequence[int] | range) -> None:
        for index in indices:
            bucket = self.buckets[index]
            if not bucket.sparse:
                for slot, p in enumerate(bucket.params):
                    p.grad = bucket.views[slot]

    def _apply(self, indices: Sequence[int]) -> None:
        """One ``optimizer.step()`` over these buckets' parameters (their allreduces done), with the
        hyperparameters recorded by ``step()``; the other parameters are left out of the groups meanwhile."""
        assert self.optimizer is not None
        ids = {id(p) for index in indices for p in self.buckets[index].params}
        self._bind_grads(indices)
        groups = self.optimizer.param_groups
        saved = [dict(g) for g in groups]
        try:
            for group, hparams in zip(groups, self._hparams):
                group.update(hparams)
                group["params"] = [p for p in group["params"] if id(p) in ids]
            with trace.span(f"optimizer, {len(indices)} bucket(s)", "step") if indices else contextlib.nullcontext():
                self.optimizer.step()
        finally:
            for group, before in zip(groups, saved):
                group.clear()
                group.update(before)
        for index in indices:
            bucket = self.buckets[index]
            bucket.update = False
            for p in bucket.params:  # consumed: .grad is None after the update, as after zero_grad()
                p.grad = None

    def _contribute_unused(self, bucket: Bucket, slot: int, p: nn.Parameter) -> object:
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _before_module(
    reducer_ref: weakref.ref[BucketedReducer], indices: tuple[int, ...], module: nn.Module, args: object
) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._before_module(indices)


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
