"""One optimiser step of the built-in trainer, as GPU users configure it:

- ``train.accumulate_steps=N``: the rank's batch is split into N equal micro-batches, each forward and backward on
  its own; the gradients are synchronised once, after the last (the first N-1 run under the sync's ``no_sync()``,
  torch DDP's contract, kept by our reducer too). Each micro-batch's loss is divided by N, so the step is the
  step of the whole batch: the trajectory does not depend on N nor on the world size.
- ``train.precision=bf16|fp16``: the forward and the loss under ``torch.autocast`` on the rank's device (bf16 on
  CPUs too); the weights, their gradients and the optimizer stay fp32, so the reducers are unchanged. fp16 adds
  ``torch.amp.GradScaler``: the loss is scaled before backward, the synchronised gradients are unscaled before the
  step, and a step whose gradients hold inf/nan is skipped. The gradients are the same on every rank after the
  allreduce, so every rank skips the same steps; the scaler's state is in the checkpoint.
- ``optim.clip_grad_norm``: the global norm of the synchronised (unscaled) gradients is clipped before the step.

Clipping and the fp16 scaler need every synchronised gradient before the first update: the forward overlap (updates
bucket by bucket as they arrive, during the next forward) cannot run with them;
``config.rules.whole_gradient_reason`` says why and the bucketed sync runs the backward overlap instead, saying so
in the banner."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

from launcher.comm import trace
from launcher.config import OptimConfig, TrainConfig
from launcher.train.batch import Batch
from launcher.train.task import Task

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def describe_precision(train: TrainConfig, optim: OptimConfig) -> str:
    """For the banner: precision, micro-batches and clipping, as they run."""
    parts = [
        {"fp32": "fp32", "bf16": "bf16 autocast", "fp16": "fp16 autocast + gradient scaler"}[train.precision],
    ]
    if train.accumulate_steps > 1:
        parts.append(f"gradients accumulated over {train.accumulate_steps} micro-batches, synchronised once")
    if optim.clip_grad_norm is not None:
        parts.append(f"global gradient norm clipped to {optim.clip_grad_norm:g}")
    return "; ".join(parts)


class Synchronising(Protocol):
    """What a step needs of the gradient sync (``comm.sync.Sync``; the tests' stand-ins)."""

    module: torch.nn.Module

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def no_sync(self) -> AbstractContextManager[None]: ...

    def step(self, optimizer: torch.optim.Optimizer) -> None: ...


class Stepper:
    """``step(sync, x, y)``: zero the gradients, the micro-batches, unscale, clip, the optimizer and scheduler
    steps. ``sync`` is the round's ``Sync`` (its module, ``no_sync``, ``zero_grad`` and ``step``)."""

    def __init__(
        self,
        train: TrainConfig,
        optim: OptimConfig,
        device: torch.device,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler,
    ) -> None:
        self.optimizer, self.scheduler, self.device = optimizer, scheduler, device
        self.micro = train.accumulate_steps
        self.dtype = AUTOCAST_DTYPES[train.precision]
        self.scaler = torch.amp.GradScaler(device.type) if train.precision == "fp16" else None
        self.clip = optim.clip_grad_norm
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.skipped = 0  # fp16 steps skipped for inf/nan gradients, this run
        self.task = Task(train.loss, train.labels_key)  # what the step minimises (train.loss), from which batch key
        self.grad_norm: float | None = None  # the last step's gradient norm before clipping (with clipping only)

    def autocast(self) -> AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.dtype) if self.dtype is not None else nullcontext()

    def step(self, sync: Synchronising, batch: Batch) -> torch.Tensor:
        """One optimiser step on this rank's batch (on its device); returns its mean loss (detached)."""
        sync.zero_grad(self.optimizer)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for i, part in enumerate(batch.chunk(self.micro) if self.micro > 1 else [batch]):
            with sync.no_sync() if i < self.micro - 1 else nullcontext():
                with trace.span("forward", "step"), self.autocast():
                    loss = self.task.loss(self.task.outputs(sync.module, part), part).float() / self.micro
                with trace.span("backward", "step"):
                    scaled = self.scaler.scale(loss) if self.scaler is not None else loss
                    scaled.backward()
            total += loss.detach()
        with trace.span("optimizer", "step"):
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.clip is not None:
                self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip))
            if self.scaler is not None:
                scale = self.scaler.get_scale()
                self.scaler.step(self.optimizer)  # skipped when a gradient holds inf/nan: on every rank alike
                self.scaler.update()
                self.skipped += self.scaler.get_scale() < scale
            else:
                sync.step(self.optimizer)  # forward overlap: buckets in flight are updated at the next forward
            self.scheduler.step()
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
