"""Optimiser and schedule from the config. The d2l notes' advice (more GPUs: larger batch and learning rate),
made a switch: with ``optim.lr_scaling=linear`` the learning rate grows with the number of ranks, as the global
batch does when each rank's batch is fixed."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from ..config import OptimConfig


def effective_lr(cfg: OptimConfig, world_size: int) -> float:
    return cfg.lr * world_size if cfg.lr_scaling == "linear" else cfg.lr


def build_optimizer(cfg: OptimConfig, model: nn.Module, world_size: int) -> torch.optim.Optimizer:
    lr = effective_lr(cfg, world_size)
    if cfg.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: OptimConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """Linear warm-up for ``warmup_steps``, then constant (``none``) or cosine to 0 at ``total_steps``."""
    warmup = cfg.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.scheduler == "none":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def describe_schedule(cfg: OptimConfig, total_steps: int) -> str:
    """For the banner: e.g. ``lr cosine to 0 over 200 steps after 10 warm-up``."""
    shape = "constant" if cfg.scheduler == "none" else f"cosine to 0 over {total_steps} steps"
    return f"lr {shape}" + (f" after {cfg.warmup_steps} warm-up" if cfg.warmup_steps else "")
