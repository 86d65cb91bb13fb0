"""An ``Engine``'s training state: the trainer's two kinds (``train/state.py``: one file rank 0 writes, or FSDP2's
shards in a DCP directory every rank writes), holding what a user's loop has instead of the trainer's schedule: the
user's own dict (``extra``), the fp16 gradient scaler and the loader's position. The checkpoints are the trainer's in
every other way (``train/saving.py``'s ``Checkpointer``: the run dir's ``checkpoints/``, atomic, pruned, in the
background under ``train.checkpoint_async``, resumable on another layout of ranks, exportable).

And the optimizer a user's loop steps (``routed``): the user's own object, its class extended so that ``step`` and
``zero_grad`` go through the engine (the gradient scaler, clipping, the sync's ``zero_grad``), its state shared."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from launcher.base.env import DistEnv
from launcher.comm.sync import Sync
from launcher.engine.model import from_skeleton
from launcher.train import checkpoint as ckpt
from launcher.train.optim import is_dtensor
from launcher.train.progress import Span
from launcher.train.regroup import holds_shards, load_local_state, local_state
from launcher.train.state import ReplicatedState, ShardedState, TrainState


class EngineParts:
    """What both kinds hold for an engine instead of the trainer's schedule and stepper (a mixin before the kind)."""

    extra: dict[str, Any]
    registered: dict[str, Any]  # the loop's own objects with a state (``Engine.register``): saved, carried, resumed
    waiting: tuple[dict[str, Any], list[dict[str, Any]]]  # a state's registered parts not yet loaded
    scaler: Optional[torch.amp.GradScaler]
    optimizer: torch.optim.Optimizer
    pos: Any
    span: Span
    job: Any

    def shape(self, global_batch: int, steps_per_epoch: int) -> None:
        """The loader's shape: its global batch and steps per epoch (the user's loop decides how many it takes)."""
        self.span = Span(global_batch, steps_per_epoch, total_steps=0, schedule_steps=0)

    def shared_state_dict(self, env: DistEnv, sync: Sync) -> dict[str, Any]:
        return {
            "extra": self.extra,  # the user's own (plain values and tensors: read back with weights_only)
            "stepper": {"scaler": self.scaler.state_dict()} if self.scaler is not None else {},
            "step": self.pos.step,
            "epoch": self.pos.epoch,
            "batch_in_epoch": self.pos.batch_in_epoch,
            "world_size": env.world_size,
            "global_batch": self.span.global_batch,
            "steps_per_epoch": self.span.steps_per_epoch,
            "hierarchical": sync.plan.hierarchical,
            "bucket_cap_mb": sync.plan.bucket_cap_mb,
            "compressed": sync.plan.compresses,
            "config": OmegaConf.to_container(OmegaConf.structured(self.job), enum_to_str=True),
            "engine": True,  # written by a user's loop (launcher.Engine), not the built-in trainer
            "registered": {name: thing.state_dict() for name, thing in self.registered.items()},
        }

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and (state.get("stepper") or {}).get("scaler"):
            self.scaler.load_state_dict(state["stepper"]["scaler"])
        self.pos.step, self.pos.epoch, self.pos.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.extra = dict(state.get("extra") or {})
        # the registered objects' states, loaded now, and those of objects not registered yet when they are (a
        # joining rank takes the state inside setup, before its loop makes its LR scheduler), with the optimizer's
        # settings as they came (a new scheduler resets them)
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self.waiting = (dict(state.get("registered") or {}), settings)
        self._load_waiting(self.registered)

    def register(self, objects: dict[str, Any]) -> None:
        for name, thing in objects.items():
            if not (callable(getattr(thing, "state_dict", None)) and callable(getattr(thing, "load_state_dict", None))):
                raise ValueError(
                    f"engine.register({name}={type(thing).__name__}): an object with state_dict() and "
                    "load_state_dict() is needed (an LR scheduler, a module, a torchmetrics metric); HINT: put plain "
                    "values in engine.save(extra)"
                )
        self.registered.update(objects)
        self._load_waiting(objects)

    def _load_waiting(self, objects: dict[str, Any]) -> None:
        saved, settings = self.waiting
        found = [name for name in objects if name in saved]
        for name in found:
            objects[name].load_state_dict(saved.pop(name))
        if found:
            for group, kept in zip(self.optimizer.param_groups, settings):
                group.update(kept)


class EngineReplicated(EngineParts, ReplicatedState):
    def whole_model(self) -> dict[str, torch.Tensor]:
        return {key: value.detach().cpu() for key, value in ckpt.unwrap(self.model).state_dict().items()}


class EngineSharded(EngineParts, ShardedState):
    skeleton: Optional[nn.Module] = None  # the user's model, empty, as it was before sharding (a job that heals)

    def regroup(self, env: DistEnv, joining: bool) -> None:
        """Healing in place (collective, the new round): the model sharded anew on this round's mesh (a new one
        from the skeleton: FSDP2 moves no sharded module to another mesh), this rank's shards and optimizer state
        in it (a survivor's own; a ``joining`` rank's are sent to it next), the user's optimizer object around the
        new parameters (its groups' settings and any LR scheduler over it kept)."""
        old, device = self.model, self.device
        local = local_state(old, self.optimizer) if holds_shards(old) else None
        names = {id(p): name for name, p in old.named_parameters()}  # (before a joining rank's model is sharded)
        if local is not None:
            assert self.skeleton is not None, "a sharded engine that heals keeps its model's skeleton"
            self.model = from_skeleton(self.skeleton, device)
        self.prepare(self.job, env, device, self.model)
        fresh = rebuilt(self.optimizer, names, self.model)
        if local is not None:
            load_local_state(self.model, fresh, local)
        self.optimizer.__dict__.update(param_groups=fresh.param_groups, state=fresh.state)  # (the loop's object)

    def whole_model(self) -> dict[str, torch.Tensor]:
        """Collective: every shard gathered (DCP's full state dict, on the CPU)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {key: value for key, value in whole.items() if isinstance(value, torch.Tensor)}


def engine_state(
    job: Any, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, scaler: Any
) -> TrainState:
    kind = EngineSharded if job.comm.reducer.sharded else EngineReplicated
    state = kind(job, model, optimizer, device)
    state.extra, state.scaler, state.registered, state.waiting = {}, scaler, {}, ({}, [])
    state.shape(0, 0)  # (the loader's shape once it is made)
    return state


def rebuilt(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module) -> torch.optim.Optimizer:
    """The user's ``optimizer`` built again, with its class, groups and settings, over ``model``'s parameters after
    sharding (FSDP2 replaces them: ``names`` maps each old parameter's id to its name)."""
    now = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        groups.append({**settings, "params": [now[names[id(p)]] for p in group["params"]]})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    if isinstance(optimizer, torch.optim.SGD) and any(is_dtensor(p) for p in now.values()):
        for settings in (defaults, *groups):  # torch has no DTensor rule for the fused SGD kernel (as train/optim.py)
            if settings.get("fused"):
                settings["fused"] = None
    return type(optimizer)(groups, **defaults)


class Plain:
    """The user's optimizer as the engine steps it: its class's own ``step`` and ``zero_grad``, past whatever was
    attached to the object (an LR scheduler wraps ``step`` on the object: it would come back through the engine)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self) -> Any:
        return type(self.optimizer).step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self.optimizer).zero_grad(self.optimizer, set_to_none)


class Routed:
    """Mixed into the user's optimizer class (``routed``): ``step`` and ``zero_grad`` are the engine's."""

    _launcher_engine: Any

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure): an Engine's optimizer takes no closure (the gradient scaler and the sync "
                "step once per backward); HINT: compute the loss, engine.backward(loss), then optimizer.step()"
            )
        self._launcher_engine.optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._launcher_engine.zero_grad(set_to_none)


def routed(optimizer: torch.optim.Optimizer, engine: Any) -> torch.optim.Optimizer:
    """The optimizer the user's loop holds: an instance of ``Engine<Class>`` (a subclass of the user's class: LR
    schedulers and ``isinstance`` accept it) that shares ``optimizer``'s state (param groups, state, hooks)."""
    cls = type(optimizer)
    kind: Any = type(f"Engine{cls.__name__}", (Routed, cls), {"__module__": __name__})
    made = object.__new__(kind)
    made.__dict__ = optimizer.__dict__  # one state: what either changes, the other sees
    made.__dict__["_launcher_engine"] = engine
    return made
