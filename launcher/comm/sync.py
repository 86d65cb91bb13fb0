"""The gradient sync as a type: one ``Sync`` per kind the plan names (``comm/sync_plan.py``'s ``reducer``), each a class
of its own behind one protocol, so the training loop (and a user's own loop) calls the same methods whatever runs
and no method asks which kind it is:

- ``DdpSync``: torch DDP, with our node-first (and compressed, abortable) comm hook where the plan or healing needs it;
- ``BucketedSync``: our ``BucketedReducer`` (buckets in flight during backward, or the next forward);
- ``ShardedSync``: FSDP2's shards inside a node (the model was sharded before the optimizer held it) and our
  ``CrossNodeStage`` across nodes.

``sync_for_plan`` builds the one the plan names, once, from plain arguments (``SyncOptions``: what the kinds need of
the job's ``comm`` settings; the config's translation is the trainer's, ``train/sync.py``). What every kind shares
(the plan, the topology, the compression and its saved state, how a heal leaves it) lives in ``BaseSync``; the kinds
are in ``comm/sync_kinds.py``."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import nn

from launcher.comm.compress import Compression
from launcher.comm.sync_plan import SyncPlan
from launcher.comm.topology import Topology
from launcher.group.abort import Abort
from launcher.group.helpers import Peers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncOptions:
    """What the kinds need of the job's ``comm`` settings beyond the plan."""

    find_unused_parameters: bool = False
    broadcast_buffers: bool = True  # rank 0's buffers before each training forward (DDP's; ours for the others)


@dataclass(frozen=True)
class SyncParts:
    """What every kind is built from: the model, the round's groups, the plan, the compression (its saved state
    taken over: ``restore_compression``), the peers (the abort signal, the job's secret) and the options."""

    model: nn.Module
    topology: Topology
    plan: SyncPlan
    compression: Compression
    peers: Peers
    options: SyncOptions = SyncOptions()


class Sync(Protocol):
    """One step's gradient sync, whatever its kind: the loop runs ``module``, calls ``zero_grad``, backward (under
    ``no_sync`` for all micro-batches but the last), ``step``; ``flush`` before it reads the model (evaluation, a
    checkpoint, the end)."""

    plan: SyncPlan  # what runs, and why (the banner's words)
    topology: Topology  # the groups: world, this node's ranks, the same local rank across nodes
    module: nn.Module  # what the forward runs (torch DDP's wrapper, or the model itself)
    compression: Compression  # what crosses nodes (none: ``Compression()``)
    description: str  # one line for the banner

    @property
    def overlaps_forward(self) -> bool:
        """Buckets may still be in flight after the optimizer step (their updates run at the next forward)."""
        ...

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes that accumulate without synchronising (every micro-batch of a step but the last)."""
        ...

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step (the bucketed reducer's own where it holds the optimizer)."""
        ...

    def flush(self) -> None:
        """Every pending update applied (forward overlap)."""
        ...

    def exposed_s(self) -> Optional[float]:
        """Time the last backward waited for communication after its own work was done (None: not measured)."""
        ...

    def compression_state(self) -> Optional[dict[str, Any]]:
        """This rank's compression state with the layout of nodes it belongs to; None uncompressed."""
        ...

    def leave(self) -> None:
        """Healing in place: this round's sync is left as it is (its groups may wait for a lost machine)."""
        ...

    def close(self) -> None: ...


class BaseSync:
    """What every kind shares: the plan, the topology, the compression, the abort signal (healing in place), the
    banner's line, and how the sync ends (``close``) or is left behind by a heal (``leave``). A kind overrides the
    steps its engine does differently; none asks which kind it is."""

    def __init__(self, parts: SyncParts) -> None:
        self.model = self.module = parts.model
        self.topology, self.plan, self.compression = parts.topology, parts.plan, parts.compression
        self.abort: Optional[Abort] = parts.peers.abort
        self.left = False  # healing in place left this round's sync behind
        self.description = ""

    def described(self, layout: str) -> None:
        """The banner's line: the kind's ``layout``, then flat or node-first, the topology and the compression."""
        plan = self.plan
        self.description = f"{layout}; {plan.strategy.describe()}; topology {self.topology.describe()}"
        why = plan.compression_reason
        compressed = f"{self.compression.describe()} ({why})" if plan.compresses else why
        if compressed:
            self.description += f"; {compressed}"
        log.debug("gradient sync: %s", self.description)

    @property
    def overlaps_forward(self) -> bool:
        return False

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def flush(self) -> None:
        pass

    def exposed_s(self) -> Optional[float]:
        return None

    def compression_state(self) -> Optional[dict[str, Any]]:
        if not self.plan.compresses:
            return None
        return {"layout": nodes_of(self.topology), **self.compression.state_dict()}

    def kept_by_abort(self) -> Any:
        """What a heal keeps referenced of this round's sync until the process ends (destructors may wait)."""
        return self

    def release(self) -> None:
        """At the end: the kind's own parts come off the model (hooks, the stage) and end."""

    def detach(self) -> None:
        """Left by a heal: what must not act on the next round's steps comes off the model (our reducer's hooks)."""

    def leave(self) -> None:
        self.detach()
        self.left = True
        if self.abort is not None:
            self.abort.keep(self.kept_by_abort())

    def close(self) -> None:
        if self.left:  # left to the graveyard: its groups may wait for the dead
            return
        self.release()
        self.topology.close()


def nodes_of(topology: Topology) -> list[list[int]]:
    """The layout of nodes (each node's global ranks) a compression state belongs to."""
    return [list(node) for node in topology.layout.nodes]


def restore_compression(
    compression: Compression, plan: SyncPlan, topology: Topology, saved: Optional[list[Any]], healed: bool
) -> None:
    """Each rank takes its own saved state on the same layout (a bit-identical continuation); else its errors and Qs
    start anew, said once (after a heal too: a joiner has none, and every rank must start alike). ``saved``: the
    checkpoint's compression state per rank; ``healed``: the sync is built again after healing in place."""
    if not plan.compresses or not (saved or healed):
        return
    env = topology.env
    mine = saved[env.rank] if saved and len(saved) == env.world_size else None
    if healed:
        why = f"healed in place: the ranks changed; {compression.warmup_steps} step(s) uncompressed first"
    elif mine is None or mine.get("layout") != nodes_of(topology):
        why = "saved on another layout of nodes"
    else:
        why = compression.load_state_dict(mine)
    if why and env.is_main:
        log.info("compression: error feedback and Qs start anew (%s)", why)


def rank0_buffers_hook(peers: Peers, module: nn.Module, _: Any) -> None:
    """Sharded training's forward pre-hook: rank 0's buffers (batch-norm statistics) before each training forward,
    as torch DDP's ``broadcast_buffers`` (FSDP2 leaves them alone)."""
    if module.training:
        peers.broadcast_buffers(module)
