"""Who shares a node with whom: the process groups the hierarchical reduction runs on.

Built collectively, on every rank, from each rank's (node, local rank) as the DistEnv says them, gathered once.
It does not assume ranks are numbered node by node, so interleaved layouts (rank r on node r % N) and uneven
ones (3 ranks on one node, 1 on another) are both right:

- ``intra``: the ranks of my node (ordered by local rank); its first member is my node's *leader*;
- ``intra_bcast``: the same ranks again, a separate group for the hierarchy's broadcasts (see collectives);
- ``inter``: the ranks with my local rank on every node that has one (for local rank 0: the leaders).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch.futures import Future

from launcher.base.env import DistEnv


@dataclass(frozen=True)
class Layout:
    """Pure description of the job's placement: ``nodes[k]`` lists node k's global ranks by local rank."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_pairs(cls, pairs: list[tuple[int, int]]) -> Layout:
        """``pairs[rank] = (node_rank, local_rank)`` -> layout; rejects what a node-first reduction can't use."""
        by_node: dict[int, dict[int, int]] = {}
        for rank, (node, local) in enumerate(pairs):
            slots = by_node.setdefault(node, {})
            if local in slots:
                raise ValueError(f"ranks {slots[local]} and {rank} both claim local rank {local} on node {node}")
            slots[local] = rank
        for node, slots in by_node.items():
            if sorted(slots) != list(range(len(slots))):
                raise ValueError(f"node {node} has local ranks {sorted(slots)}; expected 0..{len(slots) - 1}")
        return cls(tuple(tuple(slots[i] for i in range(len(slots))) for _, slots in sorted(by_node.items())))

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(n[0] for n in self.nodes)

    def node_of(self, rank: int) -> int:
        return next(i for i, n in enumerate(self.nodes) if rank in n)

    def inter_groups(self) -> list[tuple[int, ...]]:
        """One group per local rank: that local rank's member on every node that has one."""
        depth = max(len(n) for n in self.nodes)
        return [tuple(n[i] for n in self.nodes if i < len(n)) for i in range(depth)]

    @classmethod
    def gather(cls, env: DistEnv) -> Layout:
        """Collective over the default group: every rank's (node, local rank), as its DistEnv says."""
        mine = torch.tensor([env.node_rank, env.local_rank], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            mine = mine.cuda()
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        return cls.from_pairs([(int(t[0]), int(t[1])) for t in gathered])

    def interleaved(self) -> bool:
        """True when ranks are not numbered node by node (flat ring order then crosses nodes more often)."""
        return list(r for n in self.nodes for r in n) != list(range(self.world_size))


Groups = tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]


class CommThreads(Protocol):
    """Threads that run a topology's hierarchical allreduces (``collectives._Pipeline``)."""

    def submit(self, tensor: torch.Tensor, pieces: list[Any]) -> Future: ...

    def close(self) -> None: ...


@dataclass
class Topology:
    """Process groups for node-first reduction; ``None`` groups mean "just me" (nothing to do)."""

    env: DistEnv
    layout: Layout
    world: dist.ProcessGroup | None
    intra: dist.ProcessGroup | None
    intra_bcast: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None
    node_ranks: tuple[int, ...] = field(default=())  # global ranks of my node
    inter_ranks: tuple[int, ...] = field(default=())  # global ranks of my inter-node group
    launch_in_order: bool = False  # NCCL: node-first phases issued by the caller, one order (collectives)
    lanes: list[Groups] = field(default_factory=list)  # node-first groups beyond the first (``add_lane``)
    timeout: Optional[timedelta] = None  # of the sub-groups' collectives
    _threads: Optional[CommThreads] = field(default=None, repr=False)  # started on first use
    _stream: Optional[torch.cuda.Stream] = field(default=None, repr=False)

    def comm_threads(self, start: Callable[[Topology], CommThreads]) -> CommThreads:
        """The hierarchy's comm threads (``collectives``' pipeline), started by ``start`` on first use; they live
        as long as this topology."""
        if self._threads is None:
            self._threads = start(self)
        return self._threads

    def lane(self, index: int) -> Groups:
        """(intra, intra_bcast, inter) of node-first lane ``index``: 0 the topology's own, then ``add_lane``'s."""
        return (self.intra, self.intra_bcast, self.inter) if index == 0 else self.lanes[index - 1]

    def add_lane(self) -> None:
        """A second lane: another intra, intra_bcast and inter group, driven by their own comm threads, so that a
        piece that must wait for an earlier one (PowerSGD's Q for its P) does not hold up the pieces behind it.
        Collective over the default group (every rank, in program order); once; nothing to do on one node, or
        under NCCL (one thread issues every phase there: ``collectives.in_launch_order``)."""
        if self.lanes or self.num_nodes == 1 or self.launch_in_order:
            return
        nodes = [list(n) for n in self.layout.nodes]
        intra = new_groups(nodes, self.env.rank, None, self.timeout)
        intra_bcast = new_groups(nodes, self.env.rank, None, self.timeout)
        inter = new_groups([list(g) for g in self.layout.inter_groups()], self.env.rank, None, self.timeout)
        self.lanes.append((intra, intra_bcast, inter))

    def across(self, second_lane: bool = False) -> Topology:
        """A view of this topology with no node phases: each rank alone on its node, its cross-node group
        (``inter``: the ranks of its local rank on every node) the only one, so a node-first allreduce on it is
        the leaders' stage alone, on every rank (sharded training: each rank sums its own shard across nodes,
        ``comm/shard.py``). ``second_lane``: PowerSGD's (collective: ``add_lane`` first). Its comm threads are its
        own: ``close`` it too."""
        if second_lane:
            self.add_lane()
        lanes: list[Groups] = [(None, None, inter) for _, _, inter in self.lanes]
        return Topology(
            self.env,
            self.layout,
            self.world,
            None,
            None,
            self.inter,
            (self.env.rank,),
            self.inter_ranks,
            self.launch_in_order,
            lanes,
            self.timeout,
        )

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The CUDA stream the node-first phases are ordered on under NCCL (``collectives.in_launch_order``)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def close(self) -> None:
        """Stop the hierarchy's comm threads (they hold the groups): call before destroying the process group."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_nodes(self) -> int:
        return len(self.layout.nodes)

    @property
    def leader(self) -> int:
        """Global rank of my node's leader."""
        return self.node_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.env.rank == self.leader

    @property
    def alone(self) -> bool:
        """The only rank of my node: node-first has no node phases (a collective of one would only look like
        progress to the watch)."""
        return len(self.node_ranks) == 1

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def useful(self) -> bool:
        """Hierarchy only differs from a flat allreduce with several nodes, one of them holding several ranks."""
        return self.num_nodes > 1 and max(len(n) for n in self.layout.nodes) > 1

    def describe(self) -> str:
        sizes = "+".join(str(len(n)) for n in self.layout.nodes)
        extra = ", interleaved ranks" if self.layout.interleaved() else ""
        return f"{self.num_nodes} node(s) ({sizes} ranks){extra}"

    @classmethod
    def build(cls, env: DistEnv, backend: str | None = None, timeout_s: float | None = None) -> Topology:
        """Collective: every rank of the default group must call it, in the same order as its other groups.
        ``timeout_s`` bounds the sub-groups' collectives (give the default group's: torch gives new groups its
        own 30 min default, not the default group's timeout, so a rank stuck in a node-first step would hang)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "Topology.build needs an initialised process group (see launcher.group.rendezvous.process_group)"
            )
        world = dist.get_world_size()
        if world != env.world_size or dist.get_rank() != env.rank:
            raise ValueError(
                f"DistEnv says rank {env.rank}/{env.world_size} but the process group is {dist.get_rank()}/{world}"
            )
        layout = Layout.gather(env)
        node_ranks = layout.nodes[layout.node_of(env.rank)]
        inter_ranks = next(g for g in layout.inter_groups() if env.rank in g)
        # new_group is collective over the default group: every rank creates every group, in one order.
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        intra = new_groups([list(n) for n in layout.nodes], env.rank, backend, timeout)
        intra_bcast = new_groups([list(n) for n in layout.nodes], env.rank, backend, timeout)
        inter = new_groups([list(g) for g in layout.inter_groups()], env.rank, backend, timeout)
        nccl = dist.get_backend() == "nccl" if backend is None else backend == "nccl"
        return cls(env, layout, dist.group.WORLD, intra, intra_bcast, inter, node_ranks, inter_ranks, nccl, [], timeout)


def new_groups(
    members: list[list[int]], rank: int, backend: str | None, timeout: timedelta | None
) -> dist.ProcessGroup | None:
    """One group per list of ``members`` (collective over the default group: every rank creates every group, in one
    order); this rank's, or None."""
    mine = None
    for ranks in members:
        group = dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=False)
        if rank in ranks:
            mine = group
    return mine
