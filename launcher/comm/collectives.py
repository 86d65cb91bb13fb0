"""Allreduce, flat or node-first, as a Future; and the same as torch DDP comm hooks.

Node-first (hierarchical) allreduce runs in three phases:

1. ``reduce`` to the node leader over the intra-node group;
2. ``all_reduce`` among the leaders (the only bytes that cross nodes: one tensor per node, not one per rank);
3. ``broadcast`` from the leader over a second intra-node group.

Phase collectives were chosen by measurement on gloo (../shared/recipes/netns.md): ``reduce_scatter_tensor`` is
slower than a whole allreduce there, so the node phases are reduce/broadcast, not reduce-scatter/all-gather.

Under gloo the phases run on three comm threads per Topology, a pipeline fed with segments of ``SEGMENT_BYTES`` (not the
forward overlap's chunks: a chunk is one allreduce, a segment one piece of a node-first one): while the leaders
send segment k across nodes, segment k+1 is being reduced inside the node and segment k-1 shared. Measured on
2 namespaces x 2 ranks at 1 Gbit (bench/hierarchy.py): without segments the node phases add to the link time.
Each process group is driven by one thread, in submission order, which is program order and so the same on
every rank (collectives must reach a group in the same order everywhere; completion
callbacks on the backend's threads would not guarantee that, and would hold the groups on threads that must not
drop the last reference to them). Blocking collectives release the GIL, so backward keeps computing meanwhile.
Under NCCL one thread issues every phase in one order instead (``in_launch_order``: why there).
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' annotations as real objects.
import contextlib
import queue
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future

from launcher.base.sync_modes import Compress
from launcher.comm import trace
from launcher.comm.compress import Compression, Matrix, Piece
from launcher.comm.sizes import MB, mb
from launcher.comm.topology import Topology
from launcher.group.abort import Abort


def _done(tensor: torch.Tensor) -> Future:
    fut: Future = Future()
    fut.set_result(tensor)
    return fut


def _checked(done: Future, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, once ``done`` completed without error: its error (a peer gone) fails the chained future (a
    callback ignoring it would hand on the unreduced tensor as if reduced)."""
    done.wait()
    return tensor


def flat_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Future:
    """Async sum over ``group`` (default: the world); the Future's value is ``tensor``, reduced in place."""
    if dist.get_world_size(group) == 1:
        return _done(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda done: _checked(done, tensor))


SEGMENT_BYTES = 4 * MB  # a large tensor moves through the three phases in segments of this size
UNCOMPRESSED = Compression()


class _Segments:
    """One caller's tensor split into segments: its Future completes when the last segment is broadcast."""

    def __init__(self, tensor: torch.Tensor, count: int) -> None:
        self.tensor, self.left = tensor, count
        self.result: Future[torch.Tensor] = Future()
        self.lock = threading.Lock()

    def segment_done(self) -> None:
        with self.lock:
            self.left -= 1
            finished = self.left == 0
        if finished:
            self.result.set_result(self.tensor)

    def fail(self, exc: Exception) -> None:
        with self.lock:
            first = not self.result.done()
            if first:
                self.result.set_exception(exc)  # type: ignore[arg-type]


class _Pipeline:
    """Three daemon threads per lane (``Topology.lane``), one per phase and per group: reduce -> leaders'
    allreduce -> broadcast. Segments of one tensor (and successive tensors) flow through like an assembly line, so
    the inter-node link is busy while the node phases of neighbouring segments run. A piece goes down its own
    lane (``Piece.lane``; the last lane there is if there are fewer): each lane's groups see its pieces in
    submission order, the same on every rank, and a piece that waits for another's result in ``prepare`` holds up
    only its own lane."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._inboxes: list[list[queue.SimpleQueue]] = []  # per lane, per phase
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _start_lane(self) -> None:
        lane = len(self._inboxes)
        intra, intra_bcast, inter = self.topology.lane(lane)
        leader, leads = self.topology.leader, self.topology.is_leader
        inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(3)]
        suffix = f" lane {lane}" if lane else ""  # the trace's tracks
        alone = self.topology.alone

        def reduce(piece: Piece) -> None:
            if piece.prepare is not None:
                piece.prepare()
            if not alone:
                with trace.span("reduce", "reduce (node)" + suffix, mb=round(mb(piece.tensor), 3)):
                    dist.reduce(piece.tensor, dst=leader, group=intra)

        def across(piece: Piece) -> None:
            if leads:
                with trace.span("allreduce", "allreduce (leaders)" + suffix, mb=round(mb(piece.tensor), 3)):
                    piece.stage(piece.tensor, inter)

        def share(piece: Piece) -> None:
            if not alone:
                with trace.span("broadcast", "broadcast (node)" + suffix, mb=round(mb(piece.tensor), 3)):
                    dist.broadcast(piece.tensor, src=leader, group=intra_bcast)
            if piece.finish is not None:
                piece.finish()

        for i, stage in enumerate([reduce, across, share]):
            nxt = inboxes[i + 1] if i < 2 else None
            name = f"hier-{stage.__name__}" + (f"-{lane}" if lane else "")
            thread = threading.Thread(target=self._run, args=(stage, inboxes[i], nxt), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self._inboxes.append(inboxes)

    def submit(self, tensor: torch.Tensor, pieces: list[Piece]) -> Future:
        """``tensor`` in ``pieces`` (``Compression.plan``: segments of it, each with its leaders' stage)."""
        owner = _Segments(tensor, len(pieces))
        lanes = 1 + len(self.topology.lanes)
        with self._lock:
            while len(self._inboxes) < lanes:  # a lane added since (Topology.add_lane)
                self._start_lane()
        for piece in pieces:
            self._inboxes[min(piece.lane, lanes - 1)][0].put((piece, owner))
        return owner.result

    @staticmethod
    def _run(stage: Callable[[Piece], None], inbox: queue.SimpleQueue, nxt: queue.SimpleQueue | None) -> None:
        failed = None
        while (item := inbox.get()) is not None:
            piece, owner = item
            if failed is None:
                try:
                    stage(piece)
                except Exception as exc:  # collective error or timeout: the caller's wait() raises it
                    failed = exc
            if failed is not None:  # a group is broken: fail everything behind it instead of hanging
                if piece.abandon is not None:
                    piece.abandon(failed)  # a piece waiting for this one's result fails too
                owner.fail(failed)
            elif nxt is not None:
                nxt.put(item)
            else:
                owner.segment_done()
        if nxt is not None:
            nxt.put(None)

    def close(self) -> None:
        for inboxes in self._inboxes:
            inboxes[0].put(None)  # each stage passes the sentinel on when its queue is drained
        for thread in self._threads:
            thread.join()


def in_launch_order(tensor: torch.Tensor, t: Topology, pieces: list[Piece]) -> Future:
    """Node-first for NCCL (``Topology.launch_in_order``): the caller's thread issues each segment's three phases
    back to back, asynchronously, in bucket order: one launch order on every rank across the three communicators.
    NCCL needs that (kernels of communicators sharing a GPU, launched in different orders on different ranks, can
    wait for each other forever: the pipeline's three threads would interleave differently on each rank). The GPU
    orders the phases: everything runs on a side stream that first waits for the stream that computed the
    gradients, and ``work.wait()`` makes that stream (never the CPU) wait for a phase before the next; the
    Future's ``wait()`` makes the waiter's stream wait for the side stream. Under gloo (tests) each wait
    blocks: correct, not overlapped."""
    side = t.side_stream(tensor.device) if tensor.is_cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(tensor.device))
    alone = t.alone
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for piece in pieces:
            if side is not None:
                piece.tensor.record_stream(side)  # a buffer of the plan's may be freed before the stream is done
            if piece.prepare is not None:
                piece.prepare()
            if not alone:
                dist.reduce(piece.tensor, dst=t.leader, group=t.intra, async_op=True).wait()
            if t.is_leader:
                piece.stage(piece.tensor, t.inter)  # its collectives are ordered on the side stream
            if not alone:
                dist.broadcast(piece.tensor, src=t.leader, group=t.intra_bcast, async_op=True).wait()
            if piece.finish is not None:
                piece.finish()
        done: Future = Future(devices=[tensor.device]) if side is not None else Future()
        done.set_result(tensor)  # under CUDA it records the side stream: a waiter's stream waits for it
    return done


def hierarchical_allreduce(
    tensor: torch.Tensor,
    topology: Topology,
    compression: Compression = UNCOMPRESSED,
    matrices: Sequence[Matrix] = (),
) -> Future:
    """Async sum over the world, reducing inside each node before crossing nodes. Value: ``tensor``. The
    leaders' stage is ``compression``'s (``matrices``: the parameters' gradients inside ``tensor``, for PowerSGD)."""
    if topology.world_size == 1:
        return _done(tensor)
    if topology.num_nodes == 1:  # one node: nothing crosses nodes, a plain allreduce is the hierarchy
        return flat_allreduce(tensor, topology.intra)
    if topology.alone and not compression.active:  # alone on my node: the leaders' stage is all
        return flat_allreduce(tensor, topology.inter)
    pieces = compression.plan(tensor, matrices, SEGMENT_BYTES // max(1, tensor.element_size()))
    if topology.launch_in_order:
        return in_launch_order(tensor, topology, pieces)
    return topology.comm_threads(_Pipeline).submit(tensor, pieces)


def start_allreduce(
    tensor: torch.Tensor,
    topology: Topology,
    hierarchical: bool,
    compression: Compression = UNCOMPRESSED,
    matrices: Sequence[Matrix] = (),
) -> Future:
    """For callers that only ``wait()`` (the reducer): the flat path returns the backend's own future, with no
    Python callback to run on a comm thread. Measured in bench/reducer.py: that callback's GIL hand-off cost
    a few percent of step time. The value of the returned future is unspecified. A compression other than none
    goes node-first (only the leaders' stage is compressed)."""
    if hierarchical or compression.name is not Compress.none:
        return hierarchical_allreduce(tensor, topology, compression, matrices)
    if topology.world_size == 1:
        return _done(tensor)
    return dist.all_reduce(tensor, group=topology.world, async_op=True).get_future()


# ------------------------------------------------------------------ torch DDP comm hooks: (state, bucket) -> Future


def hierarchical_hook(state: Topology, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook: average a gradient bucket node-first. ``ddp.register_comm_hook(topology, hierarchical_hook)``"""
    tensor = bucket.buffer().div_(state.world_size)  # divide before reducing: no overflow in low precision
    return hierarchical_allreduce(tensor, state)


def flat_hook(state: Topology, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook equal to DDP's default allreduce, on our Future plumbing (a baseline for measurements)."""
    tensor = bucket.buffer().div_(state.world_size)
    return flat_allreduce(tensor, state.world)


class AbortableHook:
    """The DDP comm hook state of a rank whose collectives can be left (healing in place): the ``topology``, node
    first or not, and the ``abort`` signal that fails a bucket's Future at once, so DDP's backward ends instead of
    waiting for the dead. ``ddp.register_comm_hook(AbortableHook(...), abortable_hook)``"""

    def __init__(
        self,
        topology: Topology,
        hierarchical: bool,
        abort: Abort,
        compression: Compression = UNCOMPRESSED,
        keys: dict[int, int] | None = None,
    ) -> None:
        """``compression`` of what crosses nodes (not none: node-first); ``keys``: id(parameter) -> its index among
        the model's trained parameters (PowerSGD's state is kept per parameter). Collective under PowerSGD (its Q's
        own lane: ``Topology.add_lane``)."""
        self.topology, self.hierarchical, self.abort = topology, hierarchical, abort
        self.compression, self.keys = compression, keys or {}
        if compression.name is Compress.powersgd:
            topology.add_lane()


def abortable_hook(state: AbortableHook, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """``hierarchical_hook`` or ``flat_hook`` (compressed across nodes if asked), left when ``state.abort`` trips."""
    compression = state.compression
    if compression.name is Compress.none:
        hook = hierarchical_hook if state.hierarchical else flat_hook
        return state.abort.abortable(hook(state.topology, bucket))
    if bucket.index() == 0:  # DDP hands its buckets over in index order: a new step
        compression.begin_step()
    tensor = bucket.buffer().div_(state.topology.world_size)
    matrices = [Matrix(g, state.keys[id(p)]) for g, p in zip(bucket.gradients(), bucket.parameters())]
    return state.abort.abortable(hierarchical_allreduce(tensor, state.topology, compression, matrices))
