"""``launcher.comm_hook()``: the trainer's gradient sync for frameworks that wrap torch DDP themselves (Lightning,
accelerate, the Hugging Face Trainer, a plain loop), as a DDP comm hook: ``state, hook = comm_hook(compress=...)``,
then ``ddp.register_comm_hook(state, hook)``. Each bucket is averaged node first (summed inside the node, then across
nodes, then shared inside the node) and only what crosses nodes is compressed: the very hook the trainer's torch DDP
sync registers (``comm/sync_kinds.DdpSync``), chosen by the same plan (``comm/sync_plan.plan_sync``: flat or
node-first measured under ``hierarchical="auto"``, the link measured under ``compress="auto"``).

Call it on every rank, after the default process group exists and before the first backward (it is collective: it
gathers who shares a node, builds the node and cross-node groups and, under ``auto``, measures). Who shares a node
comes from the environment torchrun, ``python -m launcher`` and Slurm give (``DistEnv.resolve``), else from
``LOCAL_RANK`` with ``NODE_RANK``/``GROUP_RANK`` (Lightning's own launcher), else from the host names.

PowerSGD keeps an error and a Q per weight matrix, keyed by the parameter: the hook learns the keys from
``bucket.parameters()`` as DDP hands it the buckets of the first step (in bucket order, the same on every rank), or
takes the trainer's own (each parameter's index among the model's trained ones) from ``model=``. No
``from __future__ import annotations`` here: DDP checks the hook's annotations as real objects."""

import logging
import os
import socket
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from launcher.base.env import DistEnv
from launcher.base.sync_modes import Compress, Hierarchical, Reducer
from launcher.comm.collectives import AbortableHook, abortable_hook, flat_hook, hierarchical_hook
from launcher.comm.compress import Compression, build_compression
from launcher.comm.sizes import DDP_BUCKET_CAP_MB, MB
from launcher.comm.sync import nodes_of
from launcher.comm.sync_plan import MeasuredLinks, SyncAsk, SyncPlan, SyncWorld, plan_sync
from launcher.comm.topology import Layout, Topology
from launcher.group.abort import Abort

log = logging.getLogger(__name__)

NO_GROUP = (
    "launcher.comm_hook() needs the job's default process group; HINT: call torch.distributed.init_process_group() "
    "first (under torchrun or python -m launcher the environment is set for it), or build the hook where the "
    "framework has made the group: Lightning's Callback.on_fit_start, after accelerate's Accelerator(), in a Hugging "
    "Face TrainerCallback.on_train_begin (docs/comm-hook.md)"
)


class CommHookState(AbortableHook):
    """What ``comm_hook`` hands DDP as the hook's state: the groups (``topology``), the plan (``plan``: flat or node
    first and why, what crosses nodes), the compression with its per-parameter state, and ``buckets``: how many
    buckets the hook has averaged (0 after a step: the framework did not register it)."""

    def __init__(self, topology: Topology, plan: SyncPlan, compression: Compression, keys: dict[int, int]) -> None:
        super().__init__(topology, plan.hierarchical, Abort(), compression, keys)  # (collective under PowerSGD)
        self.plan = plan
        self.learns_keys = not keys  # no model given: the keys come from the first step's buckets
        self.buckets = 0

    def learn_keys(self, parameters: Iterable[torch.Tensor]) -> None:
        for p in parameters:
            self.keys.setdefault(id(p), len(self.keys))

    def describe(self) -> str:
        """One line: flat or node-first and why, the topology, what crosses nodes (the trainer's banner's words)."""
        plan = self.plan
        line = f"{plan.strategy.describe()}; topology {self.topology.describe()}"
        if plan.compresses:
            return f"{line}; {self.compression.describe()} ({plan.compression_reason})"
        return f"{line}; {plan.compression_reason}" if plan.compression_reason else line

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state (PowerSGD's errors and Qs, the steps so far) with the layout of nodes it
        belongs to: save it per rank with the model to resume bit for bit."""
        return {"layout": nodes_of(self.topology), **self.compression.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> str:
        """Take over this rank's saved ``state_dict()``; returns why it started anew ("" when taken whole)."""
        if state.get("layout") != nodes_of(self.topology):
            return f"saved on the layout of nodes {state.get('layout')}, not {nodes_of(self.topology)}"
        return self.compression.load_state_dict(state)

    def close(self) -> None:
        """Stop the node-first comm threads (they hold the groups); before ``destroy_process_group``, if at all."""
        self.topology.close()


def node_first_hook(state: CommHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """DDP comm hook: the bucket averaged as ``state.plan`` says (node first, compressed across nodes, or flat)."""
    state.buckets += 1
    if state.compression.name is Compress.none:  # as the trainer registers it: no abort, no callback
        return (hierarchical_hook if state.hierarchical else flat_hook)(state.topology, bucket)
    if state.learns_keys:
        state.learn_keys(bucket.parameters())
    return abortable_hook(state, bucket)


Hook = Callable[[CommHookState, dist.GradBucket], Future]


def comm_hook(
    compress: Union[str, Compress] = "none",
    *,
    powersgd_rank: int = 4,
    compress_warmup_steps: int = 10,
    hierarchical: Union[str, bool, Hierarchical] = "auto",
    model: Optional[nn.Module] = None,
    bucket_cap_mb: Optional[float] = None,
    timeout_s: Optional[float] = None,
    env: Optional[DistEnv] = None,
) -> tuple[CommHookState, Hook]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``: gradients averaged node
    first, only the cross-node stage compressed. Collective: every rank calls it, after the default process group
    exists. Options, named as the ``comm.*`` keys: ``compress`` none | bf16 | powersgd | auto (by the measured
    link); ``powersgd_rank``; ``compress_warmup_steps`` (steps sent uncompressed first); ``hierarchical`` auto
    (measured) | true | false (compression always runs node first). ``model``: the model DDP wraps (or the DDP
    module): the trainer's PowerSGD keys and the probe's size under ``auto``; ``bucket_cap_mb``: DDP's, if not its
    25 MB (the probe's size); ``timeout_s``: of the new groups' collectives (default: the default group's);
    ``env``: who shares a node (default: from the environment, see the module docstring)."""
    mode = _checked_args(compress, powersgd_rank, compress_warmup_steps, hierarchical, model, bucket_cap_mb, timeout_s)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(NO_GROUP)
    place = _placement(env)
    topology = Topology.build(place, timeout_s=timeout_s or _default_timeout_s())
    device = _device()
    trained = [p for p in model.parameters() if p.requires_grad] if model is not None else []
    model_bytes = sum(p.numel() * p.element_size() for p in trained) or int((bucket_cap_mb or DDP_BUCKET_CAP_MB) * MB)
    asked = SyncAsk(reducer=Reducer.ddp, hierarchical=mode[1], compress=mode[0], bucket_cap_mb=bucket_cap_mb)
    world = SyncWorld(topology.num_nodes, topology.world_size, topology.useful, model_bytes)
    plan = plan_sync(asked, world, MeasuredLinks(topology, device))
    compression = build_compression(plan.compression, powersgd_rank, compress_warmup_steps)
    state = CommHookState(topology, plan, compression, {id(p): i for i, p in enumerate(trained)})
    if place.is_main:
        log.info("launcher.comm_hook: %s", state.describe())
    return state, node_first_hook


def _checked_args(
    compress: object,
    powersgd_rank: object,
    warmup: object,
    hierarchical: object,
    model: object,
    bucket_cap_mb: object,
    timeout_s: object,
) -> tuple[Compress, Hierarchical]:
    """The options as the plan's Enums; a ValueError naming the value and the fix for anything else."""
    mode = Compress.of(compress)
    if mode is None:
        raise ValueError(
            f"comm_hook(compress={compress!r}) is not one of {Compress.spelled()}; HINT: compress='bf16' halves what "
            "crosses nodes, 'powersgd' sends low-rank factors, 'auto' chooses by the measured link"
        )
    node_first = Hierarchical.of(hierarchical)
    if node_first is None:
        raise ValueError(
            f"comm_hook(hierarchical={hierarchical!r}) is not one of {Hierarchical.spelled()}; HINT: 'auto' measures "
            "flat against node-first at start-up (compression always runs node first)"
        )
    if not _whole(powersgd_rank, 1):
        raise ValueError(f"comm_hook(powersgd_rank={powersgd_rank!r}) must be an int >= 1; HINT: 4 (the default)")
    if not _whole(warmup, 0):
        raise ValueError(
            f"comm_hook(compress_warmup_steps={warmup!r}) must be an int >= 0; HINT: 10 (the default), 0 to compress "
            "from the first step"
        )
    if model is not None and not isinstance(model, nn.Module):
        raise ValueError(
            f"comm_hook(model={type(model).__name__}) is not a torch.nn.Module; HINT: the model DDP wraps (or leave it "
            "out: the hook learns what it needs from DDP's buckets)"
        )
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("timeout_s", timeout_s)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"comm_hook({name}={value!r}) must be a number > 0; HINT: leave it out for the default")
    return mode, node_first


def _whole(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# how a rank knows its node: the launcher's, torchrun's or Slurm's environment; a framework's LOCAL_RANK and
# NODE_RANK/GROUP_RANK (Lightning's own launcher sets no RANK); none (then: the host name)
BY_ENV, BY_LOCAL_RANK, BY_HOST = 2, 1, 0
SAID = {BY_ENV: "the environment (DistEnv.resolve)", BY_LOCAL_RANK: "LOCAL_RANK and NODE_RANK", BY_HOST: "host names"}


def _placement(env: Optional[DistEnv]) -> DistEnv:
    """This rank's place (node, local rank) as every rank agrees on it (collective: one all_gather of integers)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if env is not None:
        if (env.rank, env.world_size) != (rank, world):
            raise ValueError(
                f"comm_hook(env=...) says rank {env.rank} of {env.world_size} but the process group is rank {rank} of "
                f"{world}; HINT: leave env out (it is read from the environment)"
            )
        return env
    how, node, local = _own_place(rank, world)
    host = socket.gethostname()
    mine = torch.tensor([how, node, local, zlib.crc32(host.encode())], dtype=torch.int64, device=_device())
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    rows = [[int(v) for v in t.tolist()] for t in gathered]
    how = min(r[0] for r in rows)  # every rank must know its place the same way, else all go by host name
    if how == BY_HOST:
        hosts: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            hosts.setdefault(row[3], []).append(r)
        order = list(hosts)
        pairs = [(order.index(row[3]), hosts[row[3]].index(r)) for r, row in enumerate(rows)]
    else:
        pairs = [(row[1], row[2]) for row in rows]
    try:
        layout = Layout.from_pairs(pairs)
    except ValueError as exc:
        raise ValueError(
            f"comm_hook(): the ranks' places from {SAID[how]} do not make nodes: {exc}; HINT: pass "
            "env=launcher.DistEnv(rank=..., local_rank=..., world_size=..., local_world_size=..., node_rank=..., "
            "num_nodes=...)"
        ) from None
    node_rank = layout.node_of(rank)
    members = layout.nodes[node_rank]
    return DistEnv(
        rank=rank,
        local_rank=members.index(rank),
        world_size=world,
        local_world_size=len(members),
        node_rank=node_rank,
        num_nodes=len(layout.nodes),
        hostname=host,
        source=SAID[how],
    )


def _own_place(rank: int, world: int) -> tuple[int, int, int]:
    """(how, node, local rank) as this rank alone knows them (0, 0 where it goes by host name)."""
    resolved = DistEnv.resolve()
    if resolved.source != "single" and (resolved.rank, resolved.world_size) == (rank, world):
        return BY_ENV, resolved.node_rank, resolved.local_rank
    local, node = os.environ.get("LOCAL_RANK"), os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK"))
    if local is not None and node is not None and local.isdigit() and node.isdigit():
        return BY_LOCAL_RANK, int(node), int(local)
    return BY_HOST, 0, 0


def _device() -> torch.device:
    """Where the default group's collectives take tensors: the current GPU under nccl, else the CPU."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _default_timeout_s() -> Optional[float]:
    """The default group's collective timeout (torch gives new groups its own default, not the default group's)."""
    try:
        return float(dist.group.WORLD._get_backend(_device()).options._timeout.total_seconds())  # type: ignore[union-attr]
    except (AttributeError, RuntimeError):
        return None
