"""How the trainer's gradients are averaged: torch DDP (optionally with our node-first comm hook) or our
BucketedReducer, flat or hierarchical as ``comm.hierarchical`` says (``auto`` measures at start-up).
One object, one interface, so the training loop has no reducer branches."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm import Topology, hierarchical_hook
from ..comm.reducer import MB, BucketedReducer
from ..comm.strategy import StrategyChoice, choose
from ..config import CommConfig
from ..dist import broadcast_buffers
from ..env import DistEnv

log = logging.getLogger(__name__)


class GradientSync:
    def __init__(self, model: nn.Module, env: DistEnv, device: torch.device, cfg: CommConfig,
                 resumed_hierarchical: Optional[bool] = None) -> None:
        self.model = model
        self.topology = Topology.build(env)
        model_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        probe_numel = max(1, min(model_numel, int(cfg.bucket_cap_mb * MB) // 4))
        if cfg.hierarchical == "auto" and resumed_hierarchical is not None:
            self.choice = StrategyChoice(bool(resumed_hierarchical), "kept from the checkpoint this run resumes")
        else:
            self.choice = choose(self.topology, cfg.hierarchical, probe_numel, device)
        self.reducer: Optional[BucketedReducer] = None
        if cfg.reducer == "bucketed":
            self.reducer = BucketedReducer(
                model, self.topology, bucket_cap_mb=cfg.bucket_cap_mb, first_bucket_mb=cfg.first_bucket_mb,
                hierarchical=self.choice.hierarchical, find_unused_parameters=cfg.find_unused_parameters,
            )
            self.module: nn.Module = model
            layout = self.reducer.describe()
        else:
            ddp = DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=cfg.bucket_cap_mb
            )
            if self.choice.hierarchical:
                ddp.register_comm_hook(self.topology, hierarchical_hook)
            self.module = ddp
            layout = f"torch DDP, bucket cap {cfg.bucket_cap_mb} MB"
        self.description = f"{layout}; {self.choice.describe()}; topology {self.topology.describe()}"
        log.debug("gradient sync: %s", self.description)

    @property
    def hierarchical(self) -> bool:
        return self.choice.hierarchical

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()  # keeps .grad as views into the buckets
        else:
            optimizer.zero_grad(set_to_none=True)

    def exposed_s(self) -> Optional[float]:
        """Time the last backward waited for communication after its own work was done (bucketed only)."""
        return self.reducer.last_wait_s if self.reducer is not None else None

    def sync_buffers(self) -> None:
        """Rank 0's buffers (batch-norm statistics) everywhere; DDP does it in every forward already."""
        if self.reducer is not None:
            broadcast_buffers(self.model)

    def close(self) -> None:
        self.topology.close()
