"""The gradient sync's modes, the choices a user types (``comm.reducer``, ``comm.hierarchical``, ``comm.overlap``,
``comm.compress``, ``comm.shard``): one Enum each, shared by the config (its schema's fields) and the sync engine
(``comm/``, which never reads the config). Torch-free.

Each member's name is its value, the text the user types: OmegaConf looks a member up by its name (on the command
line, in YAML) and writes its name back (``config.yaml`` of a run dir), so that text is what it always was. They
are ``str`` Enums that print as that text (``f"{Compress.bf16}"`` is ``bf16``, on every Python) and that
``summary.json`` writes as it; inside the launcher they are compared as members (``is Compress.powersgd``)."""

from __future__ import annotations

from enum import Enum
from typing import Optional, TypeVar

M = TypeVar("M", bound="Mode")


class Mode(str, Enum):
    """A choice typed as text: its name and its value are that text."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def of(cls: type[M], value: object) -> Optional[M]:
        """The member ``value`` spells (a member, its text, or a bool for true/false as YAML and Hydra read them),
        or None."""
        try:
            return cls(str(value).lower() if isinstance(value, bool) else value)
        except (ValueError, TypeError):
            return None

    @classmethod
    def spelled(cls) -> str:
        """The members as a user types them: ``none, bf16, powersgd or auto``."""
        names = [member.value for member in cls]
        return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


class Reducer(Mode):
    """``comm.reducer``: who averages the gradients."""

    ddp = "ddp"  # torch DistributedDataParallel
    bucketed = "bucketed"  # our BucketedReducer (launcher/comm/reducer.py)
    fsdp = "fsdp"  # torch's FSDP2 sharding inside a node, our stage across nodes (launcher/comm/shard.py)

    @property
    def sharded(self) -> bool:
        """The one answer to "is this job sharded?": the model and optimizer are FSDP2's shards, every rank takes
        part in every forward, a checkpoint is a directory of shards (``SyncPlan.sharded`` reads it)."""
        return self is Reducer.fsdp


class Backend(Mode):
    """``comm.backend``: the process group's; ``auto`` is what the job's devices call for (``config.rules.job_backend``:
    nccl between GPUs, gloo on CPUs)."""

    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Shard(Mode):
    """``comm.shard`` under ``comm.reducer=fsdp``: the ranks one model is sharded among; ``auto`` is one of the two
    others once the job's shape is known (``resolve``)."""

    auto = "auto"  # node where a node holds several ranks, world where each holds one
    node = "node"  # the ranks of a node (replicated across nodes: only each shard's gradient crosses the link)
    world = "world"  # every rank (one flat group: every all-gather and reduce-scatter crosses the link)

    def resolve(self, nodes: int, per_node: int) -> Shard:
        """``node`` or ``world`` on ``nodes`` node(s) of ``per_node`` rank(s): as set, or for ``auto`` ``node``
        where a node holds several ranks (or there is one node: both are every rank) and ``world`` where each
        node holds one (sharding inside it would shard nothing: every rank would hold the whole model)."""
        if self is not Shard.auto:
            return self
        return Shard.world if per_node == 1 and nodes > 1 else Shard.node


class Hierarchical(Mode):
    """``comm.hierarchical``: reduce inside a node first; ``auto`` measures both at start-up."""

    auto = "auto"
    true = "true"
    false = "false"

    @property
    def forced(self) -> Optional[bool]:
        """True or False as the user set it; None under ``auto``."""
        return None if self is Hierarchical.auto else self is Hierarchical.true


class Overlap(Mode):
    """``comm.overlap``: what our reducer's communication hides behind."""

    forward = "forward"  # the optimizer and the next forward (each bucket updated as soon as it is reduced)
    backward = "backward"  # the rest of backward (every bucket waited for at its end)


class Compress(Mode):
    """``comm.compress``: what crosses nodes; ``auto`` chooses by the measured link (one of the three others)."""

    none = "none"
    bf16 = "bf16"
    powersgd = "powersgd"
    auto = "auto"
