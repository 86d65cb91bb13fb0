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


def fusable(model: nn.Module, precision: str) -> bool:
    """Whether torch's fused optimizer kernels apply: one pass over each parameter's tensors instead of one per
    operation (bench/optimizer.py: SGD's step 2.15x, AdamW's 3.6x the plain loop's on the CPU; the compressed job of
    bench/end_to_end.py 3.2x torch DDP flat instead of 3.0x). Floating-point parameters on the CPU or a GPU, no
    sparse gradients (an ``nn.Embedding(sparse=True)``: the fused kernels refuse them) and no fp16 gradient scaler
    (its skip of a step with inf gradients stays the plain optimizer's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sparse = any(getattr(m, "sparse", False) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))
    on = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return bool(params) and on and not sparse and precision != "fp16"


def build_optimizer(
    cfg: OptimConfig, model: nn.Module, world_size: int, precision: str = "fp32"
) -> torch.optim.Optimizer:
    """SGD (with momentum) or AdamW over the model's parameters, fused where ``fusable``. A fused SGD's momentum
    buffers exist from the start (zeros): its kernel takes every buffer or none, and a parameter first used after
    the others would be the one without; with no dampening the first step gives ``0.9 * 0 + g = g``, exactly what
    the unfused SGD's first step sets."""
    lr, fused = effective_lr(cfg, world_size), fusable(model, precision)
    if cfg.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=fused or None)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused or None
    )
    if fused and cfg.momentum:
        for p in model.parameters():
            if p.requires_grad:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return optimizer


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
