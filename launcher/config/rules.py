"""Rules the launcher derives from a whole job's config (torch-free: the head applies them before anything starts,
the ranks again as they run)."""

from __future__ import annotations

import ast
import importlib.util
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launcher.base.gpus import backend_for
from launcher.base.sync_modes import Backend, Compress, Overlap, Reducer, Shard
from launcher.config.errors import ConfigError
from launcher.config.schema import JobConfig, OptimConfig, TrainConfig

TENSORBOARD_HINT = "pip install tensorboard (in this checkout: pip install -e '.[tensorboard]')"


def entry_argv(job: JobConfig) -> list[str]:
    """What ``job`` runs, in a few words (process titles): the script and its arguments, the doctor, or the trainer
    with its model and data."""
    if job.script is not None:
        return [Path(job.script).name, *job.script_args]
    if job.doctor:
        return ["doctor"]
    return ["train", str(job.model["_target_"]).rsplit(".", 1)[-1], "on", data_words(job)]


def data_words(job: JobConfig) -> str:
    """What the job's data is called in a few words: its factory's name (``data._target_``'s last part, the user's
    own data: ``mypkg.data.make_tiles`` is ``make_tiles``), else ``data.name`` (a built-in set)."""
    target = job.data._target_
    return target.rsplit(".", 1)[-1] if target else job.data.name


def entry_words(job: JobConfig) -> str:
    """``entry_argv`` as a shell takes it: ``train.py --lr 0.1``."""
    return shlex.join(entry_argv(job))


def rank_command(job: JobConfig) -> tuple[str, ...]:
    """The arguments of ``python`` for one rank of ``job`` started by an agent (``launcher.rank.entry``): its run
    dir, then what it runs (``ps`` shows the script until the rank names itself, and its title has the room)."""
    return ("-u", "-m", "launcher.rank.entry", job.run_dir, *entry_argv(job))


def job_backend(job: JobConfig) -> str:
    """The process group's backend, worked out once for the head's plan and every rank: ``comm.backend`` as set, or
    for ``auto`` what the job's GPUs call for (nccl between GPUs, gloo on CPUs). The plan's GPUs are the job's
    (``cluster.gpus_per_node``, filled in by the mode before the config is frozen), so both see the same answer."""
    backend = job.comm.backend
    return backend_for(bool(job.cluster.gpus_per_node)) if backend is Backend.auto else backend.value


def whole_gradient_reason(train: TrainConfig, optim: OptimConfig) -> Optional[str]:
    """Why the optimizer step must see every synchronised gradient at once, or None."""
    if optim.clip_grad_norm is not None:
        return "optim.clip_grad_norm needs the norm of every synchronised gradient before the first update"
    if train.precision == "fp16":
        return "train.precision=fp16: the gradient scaler checks every gradient for inf/nan before the first update"
    return None


def writes_tensorboard(job: JobConfig) -> bool:
    """``train.tensorboard=true`` in a job of the built-in trainer (a ``script=`` or doctor job writes no events)."""
    return job.train.tensorboard and job.script is None and not job.doctor


def check_tensorboard(job: JobConfig) -> None:
    """``train.tensorboard=true`` needs the tensorboard package (torch's SummaryWriter imports it): a ConfigError
    before any rank starts, not an ImportError on rank 0 once training began. Looked up, not imported (~0.1 s);
    over ssh every host is checked too (``launch/ssh/host_check.py``: any may hold rank 0 after a heal)."""
    if writes_tensorboard(job) and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "train.tensorboard=true, but the tensorboard package is not installed (torch's SummaryWriter needs it); "
            f"HINT: {TENSORBOARD_HINT}, or train.tensorboard=false"
        )


@dataclass(frozen=True)
class Heals:
    """Whether a job heals in place when a machine is lost (``bool``), and ``reason``: why, or why it restarts from
    its newest checkpoint instead."""

    on: bool
    reason: str

    def __bool__(self) -> bool:
        return self.on


def heals_in_place(job: JobConfig) -> Heals:
    """Whether a job heals in place (``launcher.heal``) when a machine is lost, with the reason either way."""
    why = _restart_reason(job)
    return Heals(False, why) if why else Heals(True, "the survivors go on in the same processes (cluster.heal)")


def _restart_reason(job: JobConfig) -> Optional[str]:
    c = job.cluster
    if not c.may_shrink:
        return "every machine is needed (cluster.min_nodes = cluster.nodes)"
    if c.kind not in ("sim", "ssh"):
        return f"{c.kind} jobs do not heal in place (the launcher's head does: +cluster=sim, +cluster=ssh)"
    if c.gpus_per_node:
        return "nccl: healing in place is built on gloo's behaviour so far"
    if not c.heal:
        return "cluster.heal=false"
    if job.script is not None and not uses_engine(job.script):
        return (
            f"{job.script} does not use launcher.Engine: its own loop cannot go on in a new process group, so it "
            "starts again on the machines left, from its first line and its own snapshot, if it keeps one (a loop "
            "through launcher.Engine heals in place: docs/your-loop.md)"
        )
    if job.doctor:
        return "doctor=true"
    if job.comm.reducer.sharded and job.comm.shard is Shard.world:
        auto = job.comm.shard_auto
        return (
            f"{f'comm.shard=auto -> world ({auto})' if auto else 'comm.shard=world'}: a lost machine takes shards no "
            "survivor holds (comm.shard=node keeps a whole replica on every machine: it heals in place)"
        )
    if job.comm.reducer.sharded and job.train.checkpoint_async:
        return "train.checkpoint_async with comm.reducer=fsdp: a sharded write in flight holds the old round's group"
    forward = job.comm.reducer is Reducer.bucketed and job.comm.overlap is Overlap.forward
    if forward and whole_gradient_reason(job.train, job.optim) is None:
        return (
            "comm.overlap=forward updates bucket by bucket during the next forward: no rank holds a whole step's "
            "state at any moment; HINT: comm.overlap=backward heals in place"
        )
    return None


def describe_planned_sharding(job: JobConfig, per_node: int) -> str:
    """``comm.reducer=fsdp`` in the trainer: which ``comm.shard`` and why (``comm.shard=auto``'s choice), who holds
    which shard and what crosses nodes ("" otherwise)."""
    comm, nodes = job.comm, job.cluster.nodes
    if not comm.reducer.sharded or job.script or job.doctor:
        return ""
    shard = comm.shard.resolve(nodes, per_node)  # (resolved already when the job's shape was known)
    chose = f"comm.shard=auto -> {shard} ({comm.shard_auto}); " if comm.shard_auto else ""
    if shard is Shard.world or nodes == 1:
        world = nodes * per_node
        said = f"{chose}FSDP2 over every rank: each of {world} holds 1/{world} of the parameters, gradients and "
        said += "optimizer state"
        if nodes > 1:
            said += "; every all-gather and reduce-scatter crosses the slowest link"
            said += " (comm.shard=node: inside a node)" if per_node > 1 else ""
        return said
    compressed = f", {comm.compress} across nodes" if comm.compress is not Compress.none else ""
    said = (
        f"{chose}FSDP2 among the {per_node} rank(s) of each node (each holds 1/{per_node} of the model), replicated "
        f"across {nodes} nodes: only each shard's gradient crosses nodes{compressed}"
    )
    if per_node == 1:
        said += "; one rank a node: every rank holds the whole model, nothing is sharded (comm.shard=world shards it)"
    return said


def uses_engine(script: str) -> bool:
    """``script`` (its own file, read, not run) uses ``launcher.Engine``: it imports it (``from launcher import
    Engine``, ``from launcher.engine import Engine``) or names ``launcher.Engine``. A loop through the engine heals
    in place; any other script restarts (``heals_in_place``). An unreadable file: False (the plan says so)."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"), filename=script)
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("launcher", "launcher.engine"):
            if any(alias.name == "Engine" for alias in node.names):
                return True
        if isinstance(node, ast.Attribute) and node.attr == "Engine" and isinstance(node.value, ast.Name):
            if node.value.id == "launcher":
                return True
    return False
