"""The training state, as a type of one of two kinds: what a checkpoint holds and what a live peer hands the ranks
behind it when the job heals in place. Both hold the model, the optimizer, the LR schedule over the job's span, the
stepper (its fp16 gradient scaler) and the position; they differ in how the model and optimizer are held, and so in
what they send, write, read and do when the ranks change:

- ``ReplicatedState``: every rank holds the whole model and optimizer; a checkpoint is one file rank 0 writes
  (every rank hands it its own RNG stream, log window and compression state); a heal sends the whole state;
- ``ShardedState`` (``comm.reducer=fsdp``): FSDP2's shards; a checkpoint is a DCP directory every rank writes its
  shards and its own parts into (``launcher.train.sharded``: nothing gathered); a heal sends a rank the shards of its
  place in its node, and the model is sharded anew on the next round's mesh (``regroup``: ``train/regroup.py``).

``state_kind`` chooses the kind once, from the job (``Reducer.sharded``); the trainer calls the kind's ``prepare``
on the model before the optimizer holds it. ``resume_from`` is the resume matrix: a checkpoint of either kind into a
state of either kind (``launcher.train.reshard``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Optional, Protocol

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from launcher.base.checkpoint_names import checkpoint_path, is_sharded, sharded_path
from launcher.base.devices import rng_state, set_rng_state
from launcher.base.env import DistEnv
from launcher.comm.sync import Sync
from launcher.config import JobConfig
from launcher.group.helpers import Peers
from launcher.train import checkpoint as ckpt
from launcher.train.background import Background
from launcher.train.model import build_model, shard
from launcher.train.optim import build_optimizer, build_scheduler, load_optimizer_state
from launcher.train.progress import Position, Span
from launcher.train.regroup import holds_shards, load_local_state, local_state
from launcher.train.step import Stepper


class CheckpointWriter(Protocol):
    """What a state kind writes its checkpoint with (``train/saving.py``'s ``Checkpointer`` is one): the directory, the
    peers, the background writer, and the writes both kinds share."""

    dir: Path
    peers: Peers
    background: Optional[Background]

    def write_file(self, whole: dict[str, Any], env: DistEnv, path: Path, step: int) -> None: ...

    def commit(self, write: Callable[[], object], env: DistEnv, path: Path, step: int) -> None: ...

    def cannot_write(self, env: DistEnv, path: Path, step: int, exc: OSError) -> RuntimeError: ...


class TrainState:
    """What both kinds share: the span, schedule, stepper and position, and the state beside the weights."""

    by_place: ClassVar[bool] = False  # a heal sends a rank behind the state of a peer at its own place in its node
    span: Span  # the job's shape in steps
    scheduler: LRScheduler  # over span.schedule_steps
    stepper: Stepper  # one optimiser step: micro-batches, precision, clipping

    def __init__(self, job: JobConfig, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        """The span, scheduler and stepper follow from ``shape`` (a rank joining a running job: with the job's
        shape, from the ranks it joins)."""
        self.job, self.model, self.optimizer, self.device = job, model, optimizer, device
        self.pos = Position()

    @classmethod
    def prepare(cls, job: JobConfig, env: DistEnv, device: torch.device, model: nn.Module) -> None:
        """The model as this kind holds it, before the optimizer is built around its parameters."""

    def shape(self, global_batch: int, steps_per_epoch: int) -> None:
        self.span = Span.of(self.job, global_batch, steps_per_epoch)
        self.scheduler = build_scheduler(self.job.optim, self.optimizer, self.span.schedule_steps)
        self.stepper = Stepper(self.job.train, self.job.optim, self.device, self.optimizer, self.scheduler)

    # ------------------------------------------------------------ what a heal sends, what a checkpoint holds
    def weights(self) -> dict[str, Any]:
        """The model and optimizer as this kind sends them to a rank behind (healing in place)."""
        raise NotImplementedError

    def load_weights(self, state: dict[str, Any]) -> None:
        """``weights``' counterpart."""
        raise NotImplementedError

    def load_file(self, path: Path, saved: dict[str, Any]) -> None:
        """A file checkpoint's whole model and optimizer (``saved``: what ``path`` holds) into this kind's."""
        raise NotImplementedError

    def save(self, checkpointer: CheckpointWriter, sync: Sync, env: DistEnv, step: int, window: dict[str, Any]) -> None:
        """Collective: this step's checkpoint in this kind's layout, with every rank's own RNG stream, log window
        (``Totals.partial``: its own sums, which the log adds) and compression state (its own error feedback)."""
        raise NotImplementedError

    def regroup(self, env: DistEnv, joining: bool) -> None:
        """Collective (the new round, every rank): the model and optimizer as the next round holds them."""

    def state_dict(self, env: DistEnv, sync: Sync) -> dict[str, Any]:
        return {**self.weights(), **self.shared_state_dict(env, sync)}

    def shared_state_dict(self, env: DistEnv, sync: Sync) -> dict[str, Any]:
        """All of ``state_dict`` but the model and optimiser (what a sharded checkpoint's rank 0 writes beside the
        shards: ``train.pt``), with the world size and the sync's measured choices (a resume on the same world size
        keeps them)."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "stepper": self.stepper.state_dict(),  # the fp16 gradient scaler
            "step": self.pos.step,
            "epoch": self.pos.epoch,
            "batch_in_epoch": self.pos.batch_in_epoch,
            "world_size": env.world_size,
            "global_batch": self.span.global_batch,  # the job's shape, for a machine joining in place
            "steps_per_epoch": self.span.steps_per_epoch,
            "schedule_steps": self.span.schedule_steps,  # the LR schedule's span: a resume with another one says so
            "hierarchical": sync.plan.hierarchical,
            "bucket_cap_mb": sync.plan.bucket_cap_mb,
            "compressed": sync.plan.compresses,  # a resume on another layout says its compression starts anew
            "config": OmegaConf.to_container(OmegaConf.structured(self.job), enum_to_str=True),  # weights_only loads
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_weights(state)
        self.load_shared_state_dict(state)

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        """After the model and optimiser are loaded (the optimiser's learning rates first: the schedule's after)."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.stepper.load_state_dict(state.get("stepper") or {})
        self.pos.step, self.pos.epoch, self.pos.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]

    def take(self, state: dict[str, Any], joining: bool) -> None:
        """Healing in place: the state a live peer sent this rank, behind it; ``joining``: first the job's shape as it
        started, whatever this rank's place was before it joined."""
        if joining:
            self.shape(state["global_batch"], state["steps_per_epoch"])
        self.load_state_dict(state)


class ReplicatedState(TrainState):
    def weights(self) -> dict[str, Any]:
        return {"model": ckpt.unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_weights(self, state: dict[str, Any]) -> None:
        ckpt.load_model_state(self.model, state)
        load_optimizer_state(self.optimizer, state["optimizer"])

    def load_file(self, path: Path, saved: dict[str, Any]) -> None:
        self.load_weights(saved)

    def save(self, checkpointer: CheckpointWriter, sync: Sync, env: DistEnv, step: int, window: dict[str, Any]) -> None:
        """Every rank hands rank 0 its own parts; rank 0 writes one file (``Checkpointer.write_file``)."""
        mine = sync.compression_state()
        gathered = checkpointer.peers.gather_object((rng_state(), window, mine))
        if gathered is None:  # not rank 0
            return
        own = {} if mine is None else {"compression": [c for *_, c in gathered]}
        parts = {"rng": [r for r, *_ in gathered], "log_window": [w for _, w, _ in gathered]}
        whole = dict(self.state_dict(env, sync), **parts, **own)
        checkpointer.write_file(whole, env, checkpoint_path(checkpointer.dir, step), step)


class ShardedState(TrainState):
    by_place = True  # (the shards of a rank's place in its node)
    _group: Any = None  # asynchronous saves: a gloo group of their own (collective: made at the first save)

    @classmethod
    def prepare(cls, job: JobConfig, env: DistEnv, device: torch.device, model: nn.Module) -> None:
        shard(job, env, device, model)  # (collective) in place, before the optimizer holds it

    def weights(self) -> dict[str, Any]:
        """This rank's shards (what a heal sends a rank at the same place in its node: ``train/regroup.py``)."""
        return {"local": local_state(self.model, self.optimizer, clone=True)}

    def load_weights(self, state: dict[str, Any]) -> None:
        load_local_state(self.model, self.optimizer, state["local"])

    def load_file(self, path: Path, saved: dict[str, Any]) -> None:
        """A replicated job's file: each rank cuts its own shards out of it."""
        from launcher.train import reshard

        reshard.check_model(path, self.model, reshard.file_shapes(saved["model"]))
        reshard.from_whole(self.model, self.optimizer, saved.pop("model"), saved.pop("optimizer"))

    def save(self, checkpointer: CheckpointWriter, sync: Sync, env: DistEnv, step: int, window: dict[str, Any]) -> None:
        """Every rank writes its shards and its own parts (none gathered); rank 0 the rest of the training state,
        then renames the whole directory (``Checkpointer.commit``)."""
        from launcher.train import sharded

        path = sharded_path(checkpointer.dir, step)
        own = {"rng": rng_state(), "log_window": window, "compression": sync.compression_state()}
        train = self.shared_state_dict(env, sync) if env.is_main else None
        args = (path, self.model, self.optimizer, checkpointer.peers, env.rank, own, train)
        background = checkpointer.background
        if background is None:
            checkpointer.commit(lambda: sharded.save(*args), env, path, step)
            return
        if self._group is None:
            self._group = torch.distributed.new_group(backend="gloo")
        background.wait("the next checkpoint")
        try:
            finish = sharded.save_async(*args, background.stager, self._group)
        except OSError as exc:
            raise checkpointer.cannot_write(env, path, step, exc) from exc
        background.start(step, lambda: checkpointer.commit(finish, env, path, step))

    def regroup(self, env: DistEnv, joining: bool) -> None:
        """The model sharded anew on this round's mesh, the optimizer built again, this rank's shards and optimizer
        state in them (a survivor's own; a ``joining`` rank's are sent to it next). The schedule and the stepper go
        on (a joining rank takes the job's shape with the state it is sent)."""
        job, device, local, model = self.job, self.device, None, self.model
        if holds_shards(model):  # a survivor (or a joining rank whose round did not form): sharded anew, shards kept
            local = local_state(model, self.optimizer)
            streams = rng_state()  # (build_model seeds every generator with the job's seed)
            model = build_model(job, device)
            set_rng_state(streams)
        shard(job, env, device, model)
        optimizer = build_optimizer(job.optim, model, env.world_size, job.train.precision)
        kept = None if joining else (self.scheduler.state_dict(), self.stepper.state_dict())
        self.model, self.optimizer = model, optimizer
        if kept is not None:
            self.shape(self.span.global_batch, self.span.steps_per_epoch)  # around the new optimizer
        if local is not None:
            load_local_state(model, optimizer, local)  # (its learning rates too: after the schedule set its own)
        if kept is not None:
            self.scheduler.load_state_dict(kept[0])
            self.stepper.load_state_dict(kept[1])


def state_kind(job: JobConfig) -> type[TrainState]:
    """The kind of ``job``'s training state."""
    return ShardedState if job.comm.reducer.sharded else ReplicatedState


def resume_from(state: TrainState, path: Path, saved: dict[str, Any]) -> None:
    """The resume matrix (collective): the checkpoint at ``path`` (``saved``: what rank 0 read of it, with this rank's
    own parts) into ``state``, whichever kind wrote it and whichever this job is. A DCP directory reads each rank
    what it asks for (its shards, or the whole model: DCP reshards); a file is the kind's ``load_file``."""
    if is_sharded(path):
        from launcher.train import reshard, sharded  # (FSDP2 and DCP: imported by the jobs that need them)

        reshard.check_model(path, state.model, reshard.dcp_shapes(path))
        sharded.load_shards(path, state.model, state.optimizer)
    else:
        state.load_file(path, saved)
    state.load_shared_state_dict(saved)
