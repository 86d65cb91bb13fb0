"""The forward overlap: ``loss.backward()`` returns without waiting, ``reducer.step()`` replaces
``optimizer.step()``, and each bucket's parameters are updated the moment its allreduce has completed, at the
latest just before the first module that holds them runs its next forward (``updates.py``). The tail of
communication then hides behind the optimizer and the next forward. This module sends the buckets.

- Chunks: buckets travel in pieces of ``chunk_mb``, pooled most urgent first (the first layers' buckets, which
  backward produces last and the next forward needs first). At each bucket event the pass sends what a model of
  the link (one queue drained at the link's rate, ``schedule.py``) would carry by the next event, so that later,
  more urgent chunks find a short queue. Every rank derives that model from the same measurement (the first
  ``WARMUP_STEPS`` synchronised passes run as in the backward mode, their event times and link rate agreed by one
  allreduce), so every rank launches the same chunks in the same order.
- The tail: when the first layer is an ``nn.Linear``, its weight gradient is computed in row blocks and each chunk
  leaves as soon as its rows exist, overtaking the second layer's chunks (``tail.py`` calls ``tail_start``,
  ``tail_rows`` and ``tail_end`` here).
- A parameter must be read by the module that holds it (or after it): one read earlier in the forward would see
  its old value, which autograd then reports as a tensor "modified by an inplace operation" in backward
  (``overlap="backward"`` is the fix).

The reducer core (``reducer.py``) owns the buckets and their launch order and calls in here at each step of a
pass; this module calls back through the small ``Core`` protocol, ``tail.py`` through ``TailSink``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from typing import Protocol

import torch
from torch import nn

from launcher.comm.buckets import Bucket, whole_parameter_chunks
from launcher.comm.schedule import WarmUp
from launcher.comm.sizes import nbytes
from launcher.comm.tail import TailLinear, tail_linear
from launcher.comm.updates import BucketUpdates, Waits


class Core(Waits, Protocol):
    """What the forward overlap needs of the reducer core."""

    sync: bool  # False inside no_sync()
    next_bucket: int  # the next bucket event of this pass (events run in index order)
    world_size: int

    def arm(self) -> None: ...  # this backward pass begins (a no-op once it has)
    def launch(self, index: int, tensor: torch.Tensor, chunk: int | None = None) -> None: ...
    def launch_ready(self) -> None: ...  # every bucket event now due, in index order
    def reduce_now(self, tensor: torch.Tensor) -> None: ...  # one allreduce on the buckets' path, waited for


@dataclasses.dataclass
class _Pass:
    """One backward pass's sending state."""

    link_free: float = 0.0  # in the schedule's model: when the link has carried all chunks launched so far
    early_sent: int = 0  # chunks of the last bucket sent before its gradients were complete
    early_params: set[int] = dataclasses.field(default_factory=set)  # the tail layer's parameters sent that way


class ForwardOverlap:
    def __init__(
        self,
        core: Core,
        model: nn.Module,
        buckets: list[Bucket],
        where: dict[int, tuple[int, int]],
        names: dict[int, str],
        updates: BucketUpdates,
        chunk_bytes: int,
        whole_parameters: bool = False,
    ) -> None:
        """``whole_parameters``: chunks end at parameter boundaries and the tail is off (PowerSGD compresses whole
        matrices only)."""
        self.core = core  # a weakref.proxy: the reducer owns this object, not the reverse
        self.buckets, self.where, self.names = buckets, where, names
        self.world_size = core.world_size
        for bucket in buckets:
            if whole_parameters and not bucket.sparse:
                bucket.chunks = whole_parameter_chunks(bucket, chunk_bytes)
            elif not bucket.sparse:
                bucket.chunks = list(bucket.buffer.split(max(1, chunk_bytes // bucket.buffer.element_size())))
        self.warmup = WarmUp()  # measures the first passes; then its schedule says when chunks may be launched
        self.this_pass = _Pass()
        self.pool: list[tuple[int, int]] = []  # (bucket, chunk) ready to send, the next forward's needs first
        self.updates = updates  # read only: whether a step() claimed the buckets in flight
        self.early_chunks = 0  # chunks sent before their bucket's gradients were complete, all passes
        last = buckets[-1] if buckets else None
        tail = last is not None and not last.sparse and not whole_parameters
        layer = tail_linear(model, last.params) if last is not None and tail else None
        self.tail = TailLinear(weakref.ref(self), layer, chunk_bytes) if layer is not None else None

    @property
    def scheduled(self) -> bool:
        """This pass sends chunks by priority and returns without waiting (after the warm-up)."""
        return self.warmup.done

    def tail_name(self) -> str | None:
        return None if self.tail is None else self.names[id(self.tail.module.weight)]

    def close(self) -> None:
        if self.tail is not None:
            self.tail.remove()

    # ------------------------------------------------------------------ the backward pass
    def arm(self, measure_again: bool = False) -> None:
        """A backward pass begins. ``measure_again``: what crosses the link changed (compression begins): the
        schedule is measured anew."""
        if measure_again:
            self.warmup = WarmUp()
        self.this_pass = _Pass()
        self.warmup.begin_pass()

    def took(self, param: nn.Parameter) -> bool:
        """``param``'s gradient already went to its bucket row block by row block (tail.py)."""
        if id(param) not in self.this_pass.early_params:
            return False
        if param.grad is not None:
            self._untail(param, param.grad)
        return True

    def bucket_ready(self, index: int) -> None:
        """Dense bucket ``index``'s event: its chunks go first in the pool (it holds earlier layers than any
        already ready), then what the schedule lets through."""
        event = self.warmup.event()
        sent = self.this_pass.early_sent if index == len(self.buckets) - 1 else 0
        self.pool[:0] = [(index, c) for c in range(sent, len(self.buckets[index].chunks))]
        schedule, tail = self.warmup.schedule, self.tail
        if self.scheduled and schedule is not None:
            expected = tail is not None and len(tail.live) == 1  # the tail will send early (tail.py)
            self._pump(*schedule.at_event(event, expected))
        else:
            self._pump(0.0, math.inf)

    def backward_over(self) -> None:
        """Autograd's work for this pass is done: no gradient of it arrives row block by row block any more."""
        self.this_pass.early_params = set()

    def drain(self) -> None:
        """Every bucket has had its event: send whatever is still pooled."""
        self._pump(0.0, math.inf)

    def end_backward(self) -> bool:
        """True: this pass was scheduled, step() and the next forward wait, bucket by bucket."""
        scheduled = self.scheduled
        self.warmup.synced += 1
        return scheduled

    def after_wait(self) -> None:
        """A warm-up pass's allreduces all ended: timed; the last one agrees the schedule (one allreduce)."""
        dense = [b for b in self.buckets if not b.sparse]
        shares = None
        if self.tail is not None:
            last = self.buckets[-1]
            shares = self.tail.chunk_shares(last.views[-1], last.chunks)  # its weight is the bucket's end
        self.warmup.end_pass(dense, shares, self.world_size)

    def _pump(self, now: float, until: float) -> None:
        """Send pooled chunks, most urgent first, while the schedule's link would have carried them by ``until``
        (plus its slack). Depends only on agreed numbers: every rank sends the same chunks in the same order."""
        schedule = self.warmup.schedule
        while self.pool:
            index, c = self.pool[0]
            chunk = self.buckets[index].chunks[c]
            if schedule is not None and not schedule.fits(self.this_pass.link_free, now, until, nbytes(chunk)):
                break
            self.pool.pop(0)
            self._send(index, c, now)

    def _send(self, index: int, c: int, now: float) -> None:
        chunk = self.buckets[index].chunks[c]
        if self.warmup.schedule is not None:
            self.this_pass.link_free = self.warmup.schedule.carried(self.this_pass.link_free, now, nbytes(chunk))
        self.core.launch(index, chunk, chunk=c)

    # ------------------------------------------------------------------ the tail (tail.py calls these)
    def tail_start(self, bias_grad: torch.Tensor | None) -> torch.Tensor | None:
        """The tail layer's backward begins. In a synchronised scheduled pass where every earlier bucket has had
        its event, every other gradient of the last bucket is in and the layer's ``.grad`` hold nothing to add to,
        its weight's gradient is computed into the bucket and sent by chunks as its rows come: returns the weight's
        view (None: the plain path)."""
        if not (self.core.sync and self.scheduled and self.tail is not None):
            return None
        self.core.arm()
        index = len(self.buckets) - 1
        bucket = self.buckets[index]
        layer = self.tail.module
        mine = [p for p in (layer.weight, layer.bias) if p is not None and id(p) in self.where]
        if self.core.next_bucket != index or bucket.claimed or self.updates.unclaimed or bucket.pending != len(mine):
            return None
        if any(p.grad is not None for p in mine):  # no_sync micro-steps' sum, or zeroed in place: autograd adds
            return None
        if layer.bias is not None and id(layer.bias) in self.where:
            assert bias_grad is not None
            torch.div(bias_grad, self.world_size, out=bucket.views[self.where[id(layer.bias)][1]])
        self.this_pass.early_params = {id(p) for p in mine}
        return bucket.views[self.where[id(layer.weight)][1]]

    def tail_rows(self, rows: int, block: torch.Tensor) -> None:
        """The tail weight's gradient rows up to ``rows`` are computed (``block`` the last of them, not yet
        averaged): send every chunk of the last bucket they complete."""
        block.div_(self.world_size)
        index = len(self.buckets) - 1
        bucket = self.buckets[index]
        weight = bucket.views[-1]  # the tail's weight: the bucket's end
        done = weight.data_ptr() + rows * weight.stride(0) * weight.element_size()  # the bucket is filled below
        schedule, sent = self.warmup.schedule, self.this_pass.early_sent
        times = schedule.tail if schedule is not None and schedule.tail else [0.0] * len(bucket.chunks)
        while self.this_pass.early_sent < len(bucket.chunks):
            chunk = bucket.chunks[self.this_pass.early_sent]
            if chunk.data_ptr() + nbytes(chunk) > done:
                break
            self._send(index, self.this_pass.early_sent, times[self.this_pass.early_sent])
            self.this_pass.early_sent += 1
            self.early_chunks += 1
        if sent < self.this_pass.early_sent and schedule is not None and schedule.tail:  # then what fits until the next
            self._pump(*schedule.after_tail_chunk(self.this_pass.early_sent - 1))

    def tail_end(self) -> None:
        """The tail weight's gradient is complete: the last bucket's event sends what is left."""
        bucket = self.buckets[-1]
        bucket.seen |= self.this_pass.early_params
        bucket.pending -= len(self.this_pass.early_params)
        self.core.launch_ready()

    def _untail(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """The tail layer's ``param`` got a gradient from outside its module too (read in a parent's forward, say),
        after its chunks left: once they are reduced, that part is reduced alone and added, the same on every
        rank (the same model); later passes take the plain path."""
        index, slot = self.where[id(param)]
        extra = grad / self.world_size
        param.grad = None
        for future in self.buckets[index].futures:  # kept: step() claims the bucket by them
            future.wait()
        self.core.reduce_now(extra)
        self.buckets[index].views[slot].add_(extra)
        if self.tail is not None:
            warnings.warn(
                f"{self.names[id(param)]} is read outside its module too: its gradient is no longer sent as its "
                "rows are computed (the forward overlap goes on without that); HINT: read a layer's parameters "
                "only in its own forward to keep it",
                stacklevel=2,
            )
            self.tail.remove()
            self.tail = None
            self.warmup.drop_tail()
