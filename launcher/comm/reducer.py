"""Our gradient reducer (parity tests: docs/performance.md, "Our reducer vs torch DDP"): buckets whose allreduce
overlaps the backward pass. This is its core; each other concern has a room of its own (read in this order):
``buckets.py``, the bucket plan (reverse registration order, a small first bucket, then ``bucket_cap_mb``) and the
buckets (one flat buffer each, gradients as views into it; a sparse parameter alone); ``state.py``, the model's state
across ranks, as torch DDP keeps it; ``unused.py``, parameters without a gradient; ``forward.py``, the forward
overlap's sending (``schedule.py``, its model of the link; ``tail.py``, the first layer sent by row blocks),
``updates.py``, its optimizer step per bucket; ``hooks.py``, hooks that hold the reducer weakly; ``collectives.py``,
the allreduce every bucket goes through (``compress.py``, what crosses nodes). The core: ``param.grad`` is a view
into its bucket, where the optimiser reads the reduced gradient (nothing is copied back). After ``zero_grad()``
autograd hands over the gradient it computed and the hook divides it by the world size straight into the bucket: one
read, one write per element (adding into zeroed views, then dividing, costs twice the memory passes:
bench/reducer.py). Under ``no_sync()`` autograd accumulates into the views. A post-accumulate-grad hook counts each
bucket's gradients; once complete, its allreduce (flat, or node-first) is launched asynchronously, in index order,
the same on every rank. One wait, queued to run when backward finishes: ``loss.backward()`` returns with averaged
gradients (``last_wait_s``: the exposed communication). Forward overlap (``optimizer=`` given, the default then):
backward returns at once, ``step()`` replaces ``optimizer.step()``."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from launcher.base.sync_modes import Compress, Overlap
from launcher.comm import trace
from launcher.comm.buckets import Bucket, build_buckets, sparse_allreduce
from launcher.comm.collectives import start_allreduce
from launcher.comm.compress import Compression
from launcher.comm.forward import ForwardOverlap
from launcher.comm.hooks import weak_hook
from launcher.comm.model_state import ModelState
from launcher.comm.sizes import DDP_BUCKET_CAP_MB, MB, mb
from launcher.comm.topology import Topology
from launcher.comm.unused import UnusedParameters
from launcher.comm.updates import BucketUpdates, choose_overlap, forward_overlap_refusal
from launcher.group.abort import abortable
from launcher.group.helpers import Peers


class BucketedReducer:
    def __init__(
        self,
        model: nn.Module,
        topology: Topology,
        bucket_cap_mb: float = DDP_BUCKET_CAP_MB,
        first_bucket_mb: float = 1.0,
        hierarchical: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
        overlap: Overlap | str | None = None,
        chunk_mb: float = 1.0,
        peers: Peers | None = None,
        compression: Compression | None = None,
        prefer_backward: str | None = None,
    ) -> None:
        """``overlap``: None = forward where allowed, else backward (why: ``overlap_reason``; ``prefer_backward``: the
        caller's reason, kept with backward asked by name: the sync plan's); forward where not allowed is a ValueError.
        ``peers``: waits left when its abort trips, objects signed. ``compression``: of what crosses nodes."""
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb={chunk_mb} must be > 0")
        self.compression = compression = compression or Compression()
        refusal = forward_overlap_refusal(optimizer, find_unused_parameters)
        self.overlap, self.overlap_reason = choose_overlap(overlap, refusal, compression.name, prefer_backward)
        self.optimizer, self.abort, self.model = optimizer, (peers or Peers()).abort, model
        self.topology, self.world_size, self.hierarchical = topology, topology.world_size, hierarchical
        if compression.name is Compress.powersgd:
            topology.add_lane()  # Q's own lane (collective, like this constructor)
        self.find_unused_parameters = find_unused_parameters
        self.state = ModelState(model, self.world_size, broadcast_buffers, peers)  # broadcasts rank 0's state
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in named}
        self.buckets, self.where = build_buckets(model, [p for _, p in reversed(named)], first_bucket_mb, bucket_cap_mb)
        self.unused = UnusedParameters(self.names, self.world_size)
        self.sync = True  # False inside no_sync()
        self.next_bucket = 0  # this pass's next bucket event
        self.armed = False  # a synchronised backward pass is under way
        self.last_wait_s = 0.0
        self.launched = 0  # bucket allreduces started so far
        self.hooks = [p.register_post_accumulate_grad_hook(weak_hook(self, "_on_grad")) for _, p in named]
        self.hooks.append(model.register_forward_pre_hook(weak_hook(self, "_before_forward")))
        self.hooks.append(model.register_forward_hook(weak_hook(self, "_after_forward")))
        self.forward: ForwardOverlap | None = None  # the sending side of the forward overlap
        self.updates: BucketUpdates | None = None  # its optimizer side
        if self.overlap is Overlap.forward:
            assert optimizer is not None
            core = weakref.proxy(self)  # a proxy: they do not own the reducer
            self.updates = BucketUpdates(core, model, self.buckets, self.where, optimizer)
            whole = self.compression.name is Compress.powersgd
            self.forward = ForwardOverlap(
                core, model, self.buckets, self.where, self.names, self.updates, int(chunk_mb * MB), whole
            )

    # ------------------------------------------------------------------ public
    @property
    def early_chunks(self) -> int:  # chunks sent before their bucket's gradients were complete (the tail), so far
        return 0 if self.forward is None else self.forward.early_chunks

    def describe(self) -> str:
        sizes = ", ".join(f"{mb(b.buffer):.2f}" for b in self.buckets)
        overlap = f"{self.overlap} overlap" + (f" ({self.overlap_reason})" if self.overlap_reason else "")
        if self.forward is not None and (tail := self.forward.tail_name()) is not None:
            overlap += f", {tail}'s gradient sent as its rows are computed"
        path = "hierarchical" if self.hierarchical or self.compression.name is not Compress.none else "flat"
        path += "" if self.compression.name is Compress.none else f", {self.compression.describe()}"
        return f"{len(self.buckets)} bucket(s) [{sizes}] MB, {path}, {overlap}"

    def step(self) -> None:
        """The optimizer step, in place of ``optimizer.step()``. Forward overlap: the buckets whose allreduce has
        completed are updated now, the others just before their modules' next forward (or at ``flush()``), each
        with the hyperparameters of this call (an LR scheduler may step right after)."""
        if self.optimizer is None:
            raise RuntimeError("step() needs the optimizer: BucketedReducer(..., optimizer=opt); else optimizer.step()")
        if self.updates is None or not self.updates.unclaimed:  # backward overlap, warm-up, or waited for
            self.optimizer.step()
            return
        self.last_wait_s = self.updates.step()

    def flush(self) -> None:
        """Every bucket reduced and every pending update applied: before anything that reads all parameters or
        gradients at once (evaluation elsewhere, a checkpoint, gradient clipping, the end of training)."""
        if self.updates is not None:
            self.updates.flush()

    def close(self) -> None:
        """Remove the gradient and forward hooks (the model trains on without this reducer, e.g. under another).
        Updates still pending under the forward overlap are dropped: ``flush()`` first to keep them."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        for part in (self.forward, self.updates):
            if part is not None:
                part.close()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            if bucket.claimed or bucket.futures:  # forward overlap: the reducer's until applied (.grad is None)
                continue
            if set_to_none or bucket.sparse:
                for p in bucket.params:
                    p.grad = None
            else:
                bucket.buffer.zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sum."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    # ------------------------------------------------------------------ the Core protocol (forward.py)
    def arm(self) -> None:
        """A synchronised backward pass begins: count every bucket's gradients anew; the wait is queued."""
        if self.armed:
            return
        self.armed = True
        self.next_bucket = 0
        starts = self.compression.begin_step()  # True: compression begins, what crosses the link changes
        if self.forward is not None:
            self.forward.arm(measure_again=starts)
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.seen.clear()
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def launch_ready(self) -> None:
        """Bucket events, strictly in index order (the same sequence on every rank)."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            index, bucket = self.next_bucket, self.buckets[self.next_bucket]
            self.next_bucket += 1
            self.launched += 1
            if self.forward is None or bucket.sparse:
                self.launch(index, bucket.buffer)
            else:
                self.forward.bucket_ready(index)

    def launch(self, index: int, tensor: torch.Tensor, chunk: int | None = None) -> None:
        bucket = self.buckets[index]
        if bucket.sparse:
            consume = self.forward is not None and self.forward.scheduled  # .grad the reducer's until updated
            future = sparse_allreduce(bucket.params[0], self.world_size, consume)
        else:
            future = start_allreduce(tensor, self.topology, self.hierarchical, self.compression, bucket.matrices)
        bucket.futures.append(future)
        if trace.active() is not None:  # comm.trace: the allreduce on the timeline
            extra = {} if chunk is None else {"chunk": chunk}
            trace.until_done(future, f"bucket {index}", "buckets", mb=round(mb(tensor), 3), **extra)

    def reduce_now(self, tensor: torch.Tensor) -> None:
        start_allreduce(tensor, self.topology, self.hierarchical).wait()

    def wait(self, indices: Sequence[int]) -> None:
        """Wait for these buckets' allreduces (gradients averaged in place; sparse ones bound to ``.grad``)."""
        for index in indices:
            bucket = self.buckets[index]
            if not bucket.futures:
                continue
            for future in bucket.futures:
                result = abortable(future, self.abort).wait()  # healing in place: PeerLost once a machine is lost
            if bucket.sparse:
                bucket.params[0].grad = result[0]
            bucket.futures = []  # no reference to the backend's work outlives the step

    def bind_grads(self, indices: Sequence[int]) -> None:
        for bucket in (self.buckets[i] for i in indices if not self.buckets[i].sparse):
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, *_: object) -> None:
        self.state.check_unchanged()
        if self.updates is not None and self.updates.unclaimed:  # a backward not followed by step(): its
            self.updates.keep_unclaimed()  # gradients are kept, as without overlap
        self.state.sync_buffers()

    def _after_forward(self, *_: object) -> None:
        self.state.after_forward(self.sync)  # DDP's rule for the next forward's buffer broadcast
        if self.updates is not None:
            self.updates.complete_claimed()  # parameters no module claimed

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.forward is not None and self.forward.took(param):
            return
        index, slot = self.where[id(param)]
        bucket = self.buckets[index]
        if self.updates is not None:
            self.updates.before_grad(index, slot, param)
        if param.grad is not None:
            self.unused.used.add(id(param))
        if bucket.sparse:
            if self.sync:  # else autograd accumulates the sparse gradients in .grad
                self._count(bucket, param)
            return
        view = bucket.views[slot]
        grad = param.grad
        fresh = grad is not None and grad.data_ptr() != view.data_ptr()
        if not self.sync:
            if grad is not None and fresh:  # first micro-step after zero_grad: into the bucket; later ones add in place
                view.copy_(grad)
                param.grad = view
            return
        self.arm()
        if id(param) in bucket.seen:
            return  # one count per parameter per backward pass
        # average: divide before the sum (no overflow in low precision), fused with the copy into the bucket
        if grad is not None and fresh:
            torch.div(grad, self.world_size, out=view)
            param.grad = view
        else:
            view.div_(self.world_size)
        if self.forward is not None and self.forward.scheduled:  # the gradient is the reducer's until its update
            param.grad = None
        self._count(bucket, param)

    def _count(self, bucket: Bucket, param: nn.Parameter) -> None:
        self.arm()
        if id(param) in bucket.seen:
            return
        bucket.seen.add(id(param))
        bucket.pending -= 1
        if bucket.pending == 0:
            self.launch_ready()

    def _finalize(self) -> None:
        """Queued to run when autograd's work for this backward ends: its trace span starts at that moment."""
        with trace.span("wait for buckets", "step"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        self.armed = False
        if self.forward is not None:
            self.forward.backward_over()
        kept = self.unused.settle(self.buckets, self.find_unused_parameters)
        for bucket in self.buckets:
            bucket.pending = 0
        self.launch_ready()
        if self.forward is not None:
            self.forward.drain()  # whatever is still pooled (the last bucket may have been a sparse one)
        # after the buckets: on a rank whose unused parameter held a bucket back, that bucket was launched just
        # now, on another during backward; the default group must see one order on every rank
        used = self.unused.start_map(self.buckets) if self.find_unused_parameters else None
        if self.forward is not None and self.updates is not None and self.forward.end_backward():
            self.updates.unclaimed = True  # step() and the next forward wait for the buckets, one by one
            self.last_wait_s = 0.0
            return
        start = time.perf_counter()
        self.wait(range(len(self.buckets)))
        if used is not None:
            self.unused.apply_map(self.buckets, used.wait()[0], kept)
        self.unused.used.clear()
        self.last_wait_s = time.perf_counter() - start
        if self.forward is not None:
            self.forward.after_wait()
