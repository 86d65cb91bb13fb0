"""The job's gradient sync from its config: ``sync_plan`` puts the config's ``comm`` section in the plan's terms
(``comm/sync_plan.py``: flat or node-first, compression, overlap, bucket cap, and why) and ``build_sync`` builds the
one ``Sync`` the plan names (``comm/sync.py``: torch DDP with our hook, our bucketed reducer, or FSDP2's shards
with our cross-node stage; the model was sharded before: ``train/state.py``), with the compression state a resume
or a heal hands it. The training loop sees one interface and has no reducer branches."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from launcher.base.env import DistEnv
from launcher.comm import Topology
from launcher.comm.compress import build_compression
from launcher.comm.sync import Sync, SyncOptions, SyncParts, restore_compression
from launcher.comm.sync_kinds import sync_for_plan
from launcher.comm.sync_plan import MeasuredLinks, SyncAsk, SyncPlan, SyncWorld, plan_sync
from launcher.comm.updates import forward_overlap_refusal
from launcher.config import CommConfig, collective_timeout_s
from launcher.group.helpers import Peers


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


def build_sync(
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
) -> Sync:
    """Collective: the groups, the plan (the links measured where a choice needs them) and the sync it names.
    ``whole_gradient``: why the optimizer step needs every synchronised gradient at once (clipping, the fp16
    scaler), or None: then the bucketed reducer runs the backward overlap and does not hold the optimizer.
    ``peers``: the abort signal (healing in place: every bucket's wait is left when it trips) and the job's secret
    (signed object collectives). ``resumed_*``: the checkpoint's measured choices and each rank's compression
    state; ``healed``: built again after healing in place (a compression state starts anew on every rank alike)."""
    topology = Topology.build(env, timeout_s=collective_timeout_s(cfg))
    plan = sync_plan(cfg, topology, device, model, optimizer, whole_gradient, resumed_hierarchical, resumed_cap_mb)
    compression = build_compression(plan.compression, cfg.powersgd_rank, cfg.compress_warmup_steps)
    restore_compression(compression, plan, topology, resumed_compression, healed)
    options = SyncOptions(cfg.find_unused_parameters, cfg.broadcast_buffers)
    parts = SyncParts(model, topology, plan, compression, peers or Peers(), options)
    return sync_for_plan(parts, device, optimizer, bool(whole_gradient))
