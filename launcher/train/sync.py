"""How the trainer's gradients are averaged: torch DDP (optionally with our node-first comm hook), our BucketedReducer,
or FSDP2's shards with our cross-node stage (``comm/shard.py``; the model was sharded when built:
``train/model.py``), as the sync plan says (``comm/sync_plan.py``: flat or node-first, compression, overlap, bucket
cap, and why; ``sync_plan`` puts the config's ``comm`` section in its terms). One object, one interface, so the
training loop has no reducer branches."""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import AbstractContextManager
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.base.env import DistEnv
from launcher.base.sync_modes import Overlap, Reducer
from launcher.comm import Topology, hierarchical_hook
from launcher.comm.collectives import AbortableHook, abortable_hook
from launcher.comm.compress import build_compression
from launcher.comm.reducer import BucketedReducer
from launcher.comm.shard import CrossNodeStage, describe_sharding, no_sync
from launcher.comm.strategy import StrategyChoice
from launcher.comm.sync_plan import MeasuredLinks, SyncAsk, SyncPlan, SyncWorld, plan_sync
from launcher.comm.updates import forward_overlap_refusal
from launcher.config import CommConfig, collective_timeout_s
from launcher.group.abort import Abort
from launcher.group.helpers import Peers
from launcher.train.regroup import mesh_groups

log = logging.getLogger(__name__)


def sync_plan(
    cfg: CommConfig,
    topology: Topology,
    device: torch.device,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    whole_gradient: Optional[str] = None,
    kept_hierarchical: Optional[bool] = None,
    kept_cap_mb: Optional[float] = None,
) -> SyncPlan:
    """The config's ``comm`` section in the plan's terms, planned on this world (``comm/sync_plan.py``; collective: the
    links are measured where a choice needs them)."""
    asked = SyncAsk(
        reducer=cfg.reducer,
        hierarchical=cfg.hierarchical,
        compress=cfg.compress,
        overlap=cfg.overlap,
        bucket_cap_mb=cfg.bucket_cap_mb,
        first_bucket_mb=cfg.first_bucket_mb,
        whole_gradient=whole_gradient,
        forward_refusal=forward_overlap_refusal(optimizer, cfg.find_unused_parameters),
        shard=cfg.shard,
    )
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    kept = None if kept_hierarchical is None else bool(kept_hierarchical)
    world = SyncWorld(topology.num_nodes, topology.world_size, topology.useful, model_bytes, kept, kept_cap_mb)
    return plan_sync(asked, world, MeasuredLinks(topology, device))


class GradientSync:
    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        device: torch.device,
        cfg: CommConfig,
        optimizer: torch.optim.Optimizer,
        resumed_hierarchical: Optional[bool] = None,
        resumed_cap_mb: Optional[float] = None,
        resumed_compression: Optional[list[Any]] = None,
        whole_gradient: Optional[str] = None,
        peers: Optional[Peers] = None,
        healed: bool = False,
    ) -> None:
        """``whole_gradient``: why the optimizer step needs every synchronised gradient at once (clipping, the fp16
        scaler), or None: then the bucketed reducer runs the backward overlap and does not hold the optimizer.
        ``peers``: the abort signal (healing in place: every bucket's wait is left when it trips) and the job's
        secret (signed object collectives). ``resumed_compression``: the checkpoint's compression state per rank;
        ``healed``: built again after healing in place (a compression state starts anew on every rank alike)."""
        self.model, self.left = model, False  # left: healing in place left this round's sync behind
        self.abort = (peers or Peers()).abort
        self.topology = Topology.build(env, timeout_s=collective_timeout_s(cfg))
        self.plan = plan = sync_plan(
            cfg, self.topology, device, model, optimizer, whole_gradient, resumed_hierarchical, resumed_cap_mb
        )
        self.compression = build_compression(plan.compression, cfg.powersgd_rank, cfg.compress_warmup_steps)
        self._restore_compression(resumed_compression, env, healed)
        self.bucket_cap_mb = cap = plan.bucket_cap_mb
        self.reducer: Optional[BucketedReducer] = None
        self.stage: Optional[CrossNodeStage] = None  # sharded, several nodes, comm.shard=node: our cross-node stage
        self._buffers: Optional[Any] = None  # sharded: the forward pre-hook broadcasting rank 0's buffers
        self.module: nn.Module = model
        if plan.reducer is Reducer.fsdp:
            if plan.hierarchical:
                self.stage = CrossNodeStage(model, self.topology, self.compression, self.abort)
            if cfg.broadcast_buffers and any(True for _ in model.buffers()):  # as DDP's (FSDP2 leaves them alone)
                self._buffers = model.register_forward_pre_hook(functools.partial(_broadcast_buffers, peers or Peers()))
            layout = describe_sharding(model)
        elif plan.reducer is Reducer.bucketed:
            self.reducer = BucketedReducer(
                model,
                self.topology,
                bucket_cap_mb=cap,
                first_bucket_mb=plan.first_bucket_mb,
                hierarchical=plan.hierarchical,
                find_unused_parameters=cfg.find_unused_parameters,
                broadcast_buffers=cfg.broadcast_buffers,
                optimizer=None if whole_gradient else optimizer,
                overlap=plan.overlap,
                chunk_mb=cap,  # the forward overlap's chunks sized as buckets: latency a small share of each
                peers=peers,
                compression=self.compression,
                prefer_backward=plan.overlap_reason,
            )
            layout = f"bucketed, cap {cap:.2f} MB ({plan.cap_reason}): {self.reducer.describe()}"
        else:
            self.module = self._ddp(model, device, cfg)
            layout = f"torch DDP, bucket cap {cap:g} MB"
            layout += f", backward overlap ({plan.overlap_reason})" if plan.overlap_reason else ""
        self.description = f"{layout}; {plan.strategy.describe()}; topology {self.topology.describe()}"
        why = plan.compression_reason
        compressed = f"{self.compression.describe()} ({why})" if plan.compresses else why
        if compressed:
            self.description += f"; {compressed}"
        log.debug("gradient sync: %s", self.description)

    def _ddp(self, model: nn.Module, device: torch.device, cfg: CommConfig) -> DistributedDataParallel:
        """torch DDP over ``model`` with the plan's cap; our comm hook where the plan or healing needs it."""
        with warnings.catch_warnings():  # torch 2.13 renames broadcast_buffers (older ones lack the new name)
            warnings.simplefilter("ignore", FutureWarning)
            ddp = DistributedDataParallel(
                model,
                device_ids=[device] if device.type == "cuda" else None,
                bucket_cap_mb=self.plan.bucket_cap_mb,
                find_unused_parameters=cfg.find_unused_parameters,
                broadcast_buffers=cfg.broadcast_buffers,
            )
        if self.abort is not None or self.plan.compresses:  # a lost machine left behind; compression
            keys = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
            hook = AbortableHook(self.topology, self.plan.hierarchical, self.abort or Abort(), self.compression, keys)
            ddp.register_comm_hook(hook, abortable_hook)
        elif self.plan.hierarchical:
            ddp.register_comm_hook(self.topology, hierarchical_hook)
        return ddp

    @property
    def choice(self) -> StrategyChoice:
        """Flat or node-first, and why (the plan's)."""
        return self.plan.strategy

    def compression_state(self) -> Optional[dict[str, Any]]:
        """This rank's compression state (a leader's error feedback and Qs: its own), with the layout it belongs
        to; None uncompressed."""
        if not self.plan.compresses:
            return None
        return {"layout": self._nodes(), **self.compression.state_dict()}

    def _nodes(self) -> list[list[int]]:
        """The layout of nodes (each node's global ranks) a compression state belongs to."""
        return [list(node) for node in self.topology.layout.nodes]

    def _restore_compression(self, saved: Optional[list[Any]], env: DistEnv, healed: bool) -> None:
        """Each rank takes its own saved state on the same layout (a bit-identical continuation); else its errors
        and Qs start anew, said once (after a heal too: a joiner has none, and every rank must start alike)."""
        if not self.plan.compresses or not (saved or healed):
            return
        mine = saved[env.rank] if saved and len(saved) == env.world_size else None
        if healed:
            why = f"healed in place: the ranks changed; {self.compression.warmup_steps} step(s) uncompressed first"
        elif mine is None or mine.get("layout") != self._nodes():
            why = "saved on another layout of nodes"
        else:
            why = self.compression.load_state_dict(mine)
        if why and env.is_main:
            log.info("compression: error feedback and Qs start anew (%s)", why)

    @property
    def hierarchical(self) -> bool:
        return self.plan.hierarchical

    @property
    def sharded(self) -> bool:
        """FSDP2's shards: every rank takes part in every forward (evaluation in lockstep)."""
        return self.plan.reducer is Reducer.fsdp

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()  # keeps .grad as views into the buckets
        else:
            optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes that accumulate without synchronising (every micro-batch of a step but the last)."""
        if self.reducer is not None:
            return self.reducer.no_sync()
        if self.sharded:
            return no_sync(self.module)
        assert isinstance(self.module, DistributedDataParallel)
        return self.module.no_sync()

    @property
    def overlaps_forward(self) -> bool:
        """Buckets may still be in flight after the optimizer step (their updates run at the next forward)."""
        return self.reducer is not None and self.reducer.overlap is Overlap.forward

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step: the reducer's when it holds the optimizer (forward overlap or not)."""
        if self.reducer is not None and self.reducer.optimizer is not None:
            self.reducer.step()
        else:
            optimizer.step()

    def flush(self) -> None:
        """Every pending update applied: before evaluation, a checkpoint, the end (forward overlap)."""
        if self.reducer is not None:
            self.reducer.flush()

    def exposed_s(self) -> Optional[float]:
        """Time the last backward waited for communication after its own work was done (bucketed only)."""
        if self.stage is not None:
            return self.stage.last_wait_s
        return self.reducer.last_wait_s if self.reducer is not None else None

    def close(self) -> None:
        if self.left:  # left to the graveyard: its groups may wait for the dead
            return
        if self.reducer is not None:
            self.reducer.close()
        if self.stage is not None:
            self.stage.close()
        if self._buffers is not None:
            self._buffers.remove()
        self.topology.close()

    def leave(self) -> None:
        """Healing in place: this round's sync is left as it is (its groups wait for a lost machine; closing them
        would too): our reducer's hooks come off the model, the rest is kept by the abort signal until the end."""
        if self.reducer is not None:
            self.reducer.close()
        self.left = True
        if self.abort is None:
            return
        if (
            self.sharded
        ):  # the model goes to the next round's mesh (train/regroup.py): its groups are kept, not its shards
            self.abort.keep((self.topology, self.stage and self.stage.across, mesh_groups(self.model)))
        else:
            self.abort.keep(self)


def _broadcast_buffers(peers: Peers, module: nn.Module, _: Any) -> None:
    """Sharded training's forward pre-hook: rank 0's buffers (batch-norm statistics) before each training forward,
    as torch DDP's ``broadcast_buffers`` (FSDP2 leaves buffers alone)."""
    if module.training:
        peers.broadcast_buffers(module)
