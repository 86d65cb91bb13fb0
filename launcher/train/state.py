"""The training state: what a checkpoint holds and what a live peer hands the ranks behind it when the job heals in
place. The model, the optimizer, the LR schedule over the job's span, the stepper (its fp16 gradient scaler) and
the position."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from launcher.base.devices import rng_state, set_rng_state
from launcher.base.env import DistEnv
from launcher.base.sync_modes import Reducer
from launcher.config import JobConfig
from launcher.train import checkpoint as ckpt
from launcher.train.model import build_model, shard
from launcher.train.optim import build_optimizer, build_scheduler, load_optimizer_state
from launcher.train.progress import Position, Span
from launcher.train.regroup import is_sharded, load_local_state, local_state
from launcher.train.step import Stepper
from launcher.train.sync import GradientSync


class TrainState:
    span: Span  # the job's shape in steps
    scheduler: LRScheduler  # over span.schedule_steps
    stepper: Stepper  # one optimiser step: micro-batches, precision, clipping

    def __init__(self, job: JobConfig, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        """The span, scheduler and stepper follow from ``shape`` (a rank joining a running job: with the job's
        shape, from the ranks it joins)."""
        self.job, self.model, self.optimizer, self.device = job, model, optimizer, device
        self.pos = Position()

    def shape(self, global_batch: int, steps_per_epoch: int) -> None:
        self.span = Span.of(self.job, global_batch, steps_per_epoch)
        self.scheduler = build_scheduler(self.job.optim, self.optimizer, self.span.schedule_steps)
        self.stepper = Stepper(self.job.train, self.job.optim, self.device, self.optimizer, self.scheduler)

    @property
    def sharded(self) -> bool:
        """The model and optimiser are FSDP2's shards (``comm.reducer=fsdp``): a checkpoint holds them shard by shard
        (``launcher.train.sharded``), never gathered into one state dict."""
        return self.job.comm.reducer is Reducer.fsdp

    def state_dict(self, env: DistEnv, sync: GradientSync) -> dict[str, Any]:
        """With the world size and the sync's measured choices (a resume on the same world size keeps them).
        Sharded: this rank's shards (what a heal sends a rank at the same place in its node: ``train/regroup.py``)."""
        if self.sharded:
            weights = {"local": local_state(self.model, self.optimizer, clone=True)}
        else:
            weights = {"model": ckpt.unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict()}
        return {**weights, **self.shared_state_dict(env, sync)}

    def shared_state_dict(self, env: DistEnv, sync: GradientSync) -> dict[str, Any]:
        """All of ``state_dict`` but the model and optimiser: what a sharded checkpoint's rank 0 writes beside the
        shards (``train.pt``)."""
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
            "hierarchical": sync.hierarchical,
            "bucket_cap_mb": sync.bucket_cap_mb,
            "compressed": sync.plan.compresses,  # a resume on another layout says its compression starts anew
            "config": OmegaConf.to_container(OmegaConf.structured(self.job), enum_to_str=True),  # weights_only loads
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "local" in state:  # a sharded rank's, sent by a rank at the same place
            load_local_state(self.model, self.optimizer, state["local"])
        else:
            ckpt.load_model_state(self.model, state)
            load_optimizer_state(self.optimizer, state["optimizer"])
        self.load_shared_state_dict(state)

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        """After the model and optimiser are loaded (the optimiser's learning rates first: the schedule's after)."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.stepper.load_state_dict(state.get("stepper") or {})
        self.pos.step, self.pos.epoch, self.pos.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]

    def regroup(self, env: DistEnv) -> None:
        """Collective (the new round, every rank): a sharded job healing in place (``train/regroup.py``): the model
        sharded anew on this round's mesh, the optimizer built again, this rank's shards and optimizer state in them
        (a survivor's own; a joining rank's are sent to it next). The schedule and the stepper go on."""
        job, device, local = self.job, self.device, None
        model = self.model  # a rank joining the job: the model it built, still whole
        if is_sharded(model):  # a survivor: the same model, sharded anew, its shards copied in
            local = local_state(model, self.optimizer)
            streams = rng_state()  # (build_model seeds every generator with the job's seed)
            model = build_model(job, device)
            set_rng_state(streams)
        shard(job, env, device, model)
        optimizer = build_optimizer(job.optim, model, env.world_size, job.train.precision)
        shaped = hasattr(self, "span")  # (a joining rank takes the job's shape with the state it is sent)
        kept = (self.scheduler.state_dict(), self.stepper.state_dict()) if shaped else None
        self.model, self.optimizer = model, optimizer
        if shaped:
            self.shape(self.span.global_batch, self.span.steps_per_epoch)  # around the new optimizer
        if local is not None:
            load_local_state(model, optimizer, local)  # (its learning rates too: after the schedule set its own)
        if kept is not None:
            self.scheduler.load_state_dict(kept[0])
            self.stepper.load_state_dict(kept[1])

    def take(self, state: dict[str, Any], joining: bool) -> None:
        """Healing in place: the state a live peer sent this rank, behind it; ``joining``: first the job's shape as it
        started, whatever this rank's place was before it joined."""
        if joining:
            self.shape(state["global_batch"], state["steps_per_epoch"])
        self.load_state_dict(state)
