"""Data parallelism written by hand, in one process over a list of devices, as the d2l (Dive into Deep
Learning) multi-GPU chapter teaches it.

This is what DDP (and our reducer) automate across processes: split the batch, compute each shard's gradient
on its own replica, sum the gradients (``allreduce_devices``: onto the first device, then broadcast back), and
take the same SGD step everywhere. Works with ``try_all_gpus()`` on a GPU box and with ``[cpu, cpu]`` anywhere.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn


def allreduce_devices(tensors: Sequence[torch.Tensor]) -> None:
    """Sum ``tensors`` (one per device) in place: accumulate on the first device, copy the sum back to all."""
    for t in tensors[1:]:
        tensors[0][:] += t.to(tensors[0].device)
    for t in tensors[1:]:
        t[:] = tensors[0].to(t.device)


def split_batch(
    x: torch.Tensor, y: torch.Tensor, devices: Sequence[torch.device]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a batch into ``len(devices)`` equal shards, each moved to its device."""
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"batch has {x.shape[0]} inputs but {y.shape[0]} labels")
    if x.shape[0] % len(devices):
        raise ValueError(f"batch of {x.shape[0]} does not split evenly over {len(devices)} devices")
    xs, ys = x.chunk(len(devices)), y.chunk(len(devices))
    return [a.to(d) for a, d in zip(xs, devices)], [b.to(d) for b, d in zip(ys, devices)]


class HandDataParallel:
    """One replica per device, kept identical by summing gradients after every backward."""

    def __init__(self, model: nn.Module, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.replicas = [copy.deepcopy(model).to(d) for d in self.devices]

    def train_batch(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor], lr: float) -> float:
        """One SGD step on the full batch; returns the mean loss. Per-shard losses are sums, so the summed
        gradient divided by the full batch size equals the full-batch mean gradient."""
        xs, ys = split_batch(x, y, self.devices)
        losses = [loss_fn(m(a), b, reduction="sum") for m, a, b in zip(self.replicas, xs, ys)]
        for replica, loss in zip(self.replicas, losses):
            replica.zero_grad(set_to_none=True)
            loss.backward()
        with torch.no_grad():
            for params in zip(*(list(m.parameters()) for m in self.replicas)):
                allreduce_devices([p.grad for p in params])
            for replica in self.replicas:
                for p in replica.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad / x.shape[0])
        return float(sum(loss.item() for loss in losses)) / x.shape[0]
