"""Allreduce, flat or node-first, as a Future; and the same as torch DDP comm hooks.

Node-first (hierarchical) allreduce runs in three phases:

1. ``reduce`` to the node leader over the intra-node group;
2. ``all_reduce`` among the leaders (the only bytes that cross nodes: one tensor per node, not one per rank);
3. ``broadcast`` from the leader over a second intra-node group.

Phase collectives were chosen by measurement on gloo (../shared/recipes/netns.md): ``reduce_scatter_tensor`` is
slower than a whole allreduce there, so the node phases are reduce/broadcast, not reduce-scatter/all-gather.

The phases run on two comm threads per Topology, a pipeline: thread 1 runs phase 1 for bucket k+1 while thread 2
runs phases 2-3 for bucket k. Each process group is driven by one thread, in submission order, which is program
order and so the same on every rank (collectives must reach a group in the same order everywhere; completion
callbacks on the backend's threads would not guarantee that, and would hold the groups on threads that must not
drop the last reference to them). Blocking collectives release the GIL, so backward keeps computing meanwhile.
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' annotations as real objects.
import queue
import threading

import torch
import torch.distributed as dist
from torch.futures import Future

from .topology import Topology


def _done(tensor: torch.Tensor) -> Future:
    fut: Future = Future()
    fut.set_result(tensor)
    return fut


def flat_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Future:
    """Async sum over ``group`` (default: the world); the Future's value is ``tensor``, reduced in place."""
    if dist.get_world_size(group) == 1:
        return _done(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda _: tensor)


class _Pipeline:
    """Two daemon threads: [reduce to leader] -> [leaders' allreduce, broadcast from leader]."""

    def __init__(self, topology: Topology) -> None:
        t = topology
        self._leader, self._is_leader = t.leader, t.is_leader
        self._intra, self._bcast, self._inter = t.intra, t.intra_bcast, t.inter
        self._first: queue.SimpleQueue = queue.SimpleQueue()
        self._second: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, args=(self._first, self._phase1), name="hier-intra", daemon=True),
            threading.Thread(target=self._run, args=(self._second, self._phase23), name="hier-inter", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, tensor: torch.Tensor) -> Future:
        result: Future = Future()
        self._first.put((tensor, result))
        return result

    def _phase1(self, tensor: torch.Tensor, result: Future) -> None:
        dist.reduce(tensor, dst=self._leader, group=self._intra)
        self._second.put((tensor, result))

    def _phase23(self, tensor: torch.Tensor, result: Future) -> None:
        if self._is_leader:
            dist.all_reduce(tensor, group=self._inter)
        dist.broadcast(tensor, src=self._leader, group=self._bcast)
        result.set_result(tensor)

    @staticmethod
    def _run(inbox: queue.SimpleQueue, step) -> None:
        failed = None
        while (item := inbox.get()) is not None:
            tensor, result = item
            if failed is not None:  # a group is broken: fail everything behind it instead of hanging
                result.set_exception(failed)
                continue
            try:
                step(tensor, result)
            except Exception as exc:  # collective error or timeout: the caller's wait() raises it
                failed = exc
                result.set_exception(exc)

    def close(self) -> None:
        self._first.put(None)
        self._threads[0].join()
        self._second.put(None)
        self._threads[1].join()


def hierarchical_allreduce(tensor: torch.Tensor, topology: Topology) -> Future:
    """Async sum over the world, reducing inside each node before crossing nodes. Value: ``tensor``."""
    if topology.world_size == 1:
        return _done(tensor)
    if len(topology.node_ranks) == 1:  # alone on my node: the leaders' allreduce is the whole job
        return flat_allreduce(tensor, topology.inter)
    if topology.num_nodes == 1:  # one node: nothing crosses nodes, a plain allreduce is the hierarchy
        return flat_allreduce(tensor, topology.intra)
    if topology._pipeline is None:
        topology._pipeline = _Pipeline(topology)
    return topology._pipeline.submit(tensor)


def start_allreduce(tensor: torch.Tensor, topology: Topology, hierarchical: bool) -> Future:
    """For callers that only ``wait()`` (the reducer): the flat path returns the backend's own future, with no
    Python callback to run on a comm thread. Measured in bench/reducer.py: that callback's GIL hand-off cost
    a few percent of step time. The value of the returned future is unspecified."""
    if hierarchical:
        return hierarchical_allreduce(tensor, topology)
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
