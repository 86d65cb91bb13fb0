"""What an ``Engine`` checks and does around its pieces: the arguments of ``setup`` (each mistake named with its fix),
the process group a script opened, rank 0's weights on every rank, the close at exit."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from launcher.base.env import DistEnv
from launcher.config.rules import heals_in_place
from launcher.engine.model import EngineModel
from launcher.group.helpers import Peers


def check_setup(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``Engine.setup``'s arguments: a bare model, an optimizer over its parameters that has not stepped."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"engine.setup(model={type(model).__name__}): a torch.nn.Module is needed")
    wrapper = _wrapped(model)
    if wrapper:
        raise ValueError(
            f"engine.setup(): the model is wrapped already ({wrapper}); HINT: pass the bare model: the engine "
            "wraps it in the sync the job asks for (comm.reducer)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"engine.setup(optimizer={type(optimizer).__name__}): a torch.optim.Optimizer is needed")
    mine = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ValueError(
            f"engine.setup(): the optimizer holds {foreign} tensor(s) that are not this model's parameters; "
            "HINT: build it over model.parameters() of the model passed"
        )
    if optimizer.state:
        raise ValueError(
            "engine.setup(): the optimizer has stepped already (it holds state); HINT: call setup before the "
            "first step, and engine.resume() to continue from a checkpoint"
        )


def check_same_world(env: DistEnv) -> None:
    """The group the script opened is the one the environment describes (the node-first groups are built from it)."""
    here = (dist.get_rank(), dist.get_world_size())
    if here != (env.rank, env.world_size):
        raise ValueError(
            f"launcher.Engine(): the open process group says rank {here[0]} of {here[1]}, the environment rank "
            f"{env.rank} of {env.world_size} (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE: torchrun's variables); HINT: "
            "start the script with python -m launcher script=... or torchrun, or set those variables as torchrun does"
        )


def _wrapped(model: nn.Module) -> str:
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "torch DistributedDataParallel"
    if type(model).__name__.startswith("FSDP") or getattr(model, "_is_fsdp_managed_module", False):
        return "FSDP"
    if isinstance(model, EngineModel):
        return "an Engine's"
    return ""


def broadcast_weights(model: nn.Module, peers: Peers) -> None:
    """Rank 0's parameters and buffers on every rank (as torch DDP does when it wraps a model)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for param in model.parameters():
                dist.broadcast(param.data, src=0)
        peers.broadcast_buffers(model)


def closer(engine: Any) -> Any:
    """A function that closes ``engine`` at the process's exit, if it is still alive (held weakly)."""
    ref = weakref.ref(engine)

    def close() -> None:
        alive = ref()
        if alive is not None:
            alive.close()

    return close


def versions(model: nn.Module) -> tuple[int, ...]:
    """Each parameter's version counter (torch counts every in-place change of a tensor): what changed them and
    when, checked around the steps of a loop that heals in place (``check_changed``)."""
    return tuple(p._version for p in model.parameters())


def check_changed(before: tuple[int, ...], after: tuple[int, ...], inside: bool) -> None:
    """A loop that heals in place changes the model only inside ``Engine.step()``, through the optimizer the engine
    returned (a heal drops a step that was not applied, and gives the ranks behind the state of the ranks ahead:
    a change elsewhere would be lost, or made twice). ``inside``: the step's own check (its optimizer did not step)."""
    if before == after:
        return
    changed = sum(b != a for b, a in zip(before, after))
    if inside:
        raise ValueError(
            f"{changed} parameter(s) changed inside engine.step() but not through the optimizer engine.setup() "
            "returned (another optimizer, or an in-place update of your own): in a job that heals in place the "
            "engine must know whether a step was applied; HINT: step the optimizer engine.setup() returned"
        )
    raise ValueError(
        f"{changed} parameter(s) changed between two engine.step() blocks: in a job that heals in place a change "
        "outside a step is lost, or made twice, when a machine is lost; HINT: make it inside the with "
        "engine.step(): block (or register it as part of the step: docs/your-loop.md, Healing in place)"
    )


def check_schedulers(optimizer: Any, registered: dict[str, Any]) -> None:
    """A loop that heals in place registers the LR scheduler stepping its optimizer (torch's schedulers wrap the
    optimizer's ``step``): a heal gives the ranks behind the learning rate of the ranks ahead, and their scheduler
    must go on from the same count, or the ranks train with different rates from then on."""
    wrapped = getattr(vars(optimizer).get("step"), "_wrapped_by_lr_sched", False)
    if wrapped and not any(isinstance(thing, LRScheduler) for thing in registered.values()):
        raise ValueError(
            "an LR scheduler steps the optimizer engine.setup() returned, but the engine does not know it: when a "
            "machine is lost the ranks behind take the others' state, and an unregistered scheduler would go on "
            "from its own count (another learning rate on each rank); HINT: engine.register(scheduler=scheduler)"
        )


def check_heals(job: Any) -> None:
    """A job the plan runs as one that heals in place, whose engine's own settings (``Engine(reducer=...)``) make it
    one that cannot (``config.rules.heals_in_place``): named before anything is built."""
    heals = heals_in_place(job)
    if not heals:
        raise ValueError(
            f"launcher.Engine: the launcher runs this job as one that heals in place, but with the engine's settings "
            f"it cannot: {heals.reason}; HINT: give those settings on the command line, where the plan sees them"
        )
