"""Optimiser and schedule from the config. The d2l notes' advice (more GPUs: larger batch and learning rate),
made a switch: with ``optim.lr_scaling=linear`` the learning rate grows with the number of ranks, as the global
batch does when each rank's batch is fixed."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from launcher.config import OptimConfig

log = logging.getLogger(__name__)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is one of FSDP2's DTensors, without importing ``torch.distributed.tensor`` (~0.5 CPU-s a rank,
    sympy among it): only a job that imported it can hold one, so a replicated job's ranks never import it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def effective_lr(cfg: OptimConfig, world_size: int) -> float:
    return cfg.lr * world_size if cfg.lr_scaling == "linear" else cfg.lr


def fusable(model: nn.Module, precision: str) -> bool:
    """Whether torch's fused optimizer kernels apply: one pass over each parameter's tensors instead of one per
    operation (bench/optimizer.py: SGD's step 2.15x, AdamW's 3.6x the plain loop's on the CPU; the compressed job of
    bench/end_to_end.py 3.2x torch DDP flat instead of 3.0x). Floating-point, contiguous parameters on the CPU or a
    GPU (the kernels walk memory in order, and our reducer's gradients are contiguous views: a ``channels_last``
    weight would be updated from the wrong elements), no sparse gradients (an ``nn.Embedding(sparse=True)``: the
    kernels refuse them) and no fp16 gradient scaler (its skip of a step with inf gradients stays the plain
    optimizer's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    sparse = any(getattr(m, "sparse", False) for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))
    on = all(p.is_floating_point() and p.is_contiguous() and p.device.type in ("cpu", "cuda") for p in params)
    return bool(params) and on and not sparse and precision != "fp16"


def build_optimizer(
    cfg: OptimConfig, model: nn.Module, world_size: int, precision: str = "fp32"
) -> torch.optim.Optimizer:
    """SGD (with momentum) or AdamW over the model's parameters, fused where ``fusable``."""
    lr, fused = effective_lr(cfg, world_size), fusable(model, precision)
    if cfg.name != "adamw" and any(is_dtensor(p) for p in model.parameters()):
        fused = False  # FSDP2's shards: torch has no DTensor rule for the fused SGD kernel (it has AdamW's)
    optimizer: torch.optim.Optimizer
    if cfg.name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=fused or None)
    else:
        optimizer = torch.optim.SGD(
            model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused or None
        )
    _momentum_buffers(optimizer)
    if fused:
        optimizer.register_step_pre_hook(_unfuse_on_sparse)
    return optimizer


def _unfuse_on_sparse(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """A sparse gradient ``fusable`` could not foresee (a functional embedding's): the fused kernels refuse it, so
    the optimizer steps unfused from then on (the same steps, one warning)."""
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups) and any(
        p.grad is not None and p.grad.is_sparse for g in groups for p in g["params"]
    ):
        for group in groups:
            group["fused"] = None
        log.warning("a sparse gradient: the optimizer steps without torch's fused kernel from here on")


def _momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """A fused SGD's momentum buffers, each a zero one where it has none yet: its kernel takes every buffer or none,
    and a parameter first used after the others would be the one without. With no dampening the first step then
    gives ``momentum * 0 + g = g``, exactly what the unfused SGD's first step sets."""
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group["momentum"]:
            for p in group["params"]:
                if p.requires_grad and optimizer.state[p].get("momentum_buffer") is None:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, keeping how this run built it (``as_built``)."""
    with as_built(optimizer):
        optimizer.load_state_dict(state)


@contextmanager
def as_built(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around loading a saved state into ``optimizer`` (its own ``load_state_dict``, or DCP's ``set_state_dict``
    for a sharded one): torch takes each saved group's flags over the built ones, so a checkpoint written unfused
    (before the fused kernels, or where they did not apply) would decide for this run and every later checkpoint,
    and a fused one would pass over ``fusable``; the flags are put back as built."""
    built = [group.get("fused") for group in optimizer.param_groups]
    yield
    for group, fused in zip(optimizer.param_groups, built):
        group["fused"] = fused
    _momentum_buffers(optimizer)


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
