"""The model every rank builds: the same seed on every rank gives the same initial weights, checked across ranks
(a seeding bug would otherwise train garbage silently); then evaluation on the held-out split."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from hydra.utils import instantiate
from torch import nn

from launcher.base.devices import seed_all
from launcher.config import JobConfig
from launcher.dist import helpers as dist_helpers
from launcher.train.batch import as_tree, split, to_device
from launcher.train.scores import Scores
from launcher.train.task import Task


def build_model(job: JobConfig, device: torch.device) -> nn.Module:
    """Same seed on every rank -> same initial weights; checked across ranks below."""
    seed_all(job.train.seed)
    model = instantiate(job.model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model._target_={job.model['_target_']!r} built a {type(model).__name__}, not an nn.Module")
    return model.to(device)


def check_same_weights(model: nn.Module, peers: dist_helpers.Peers = dist_helpers.Peers()) -> None:
    """Fail loudly if ranks built different initial weights (a seeding bug would silently train garbage)."""
    with torch.no_grad():
        checksum = float(sum(p.double().sum().item() * (i + 1) for i, p in enumerate(model.parameters())))
    sums = peers.all_gather_object(checksum)
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        raise RuntimeError(f"initial weights differ from rank 0 on ranks {bad} (checksums {sums})")


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[Any],
    device: torch.device,
    task: Task,
    scores: Scores,
    peers: dist_helpers.Peers = dist_helpers.Peers(),
) -> dict[str, Optional[float]]:
    """The held-out split's ``loss`` (the mean over every sample), cross-entropy's ``accuracy`` and each metric of
    ``train.metrics`` by its name, over every rank's disjoint share (collective), with rank 0's buffers (batch-norm
    statistics)."""
    model.eval()
    peers.broadcast_buffers(model)
    scores.start(device)
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, count, right, count
    for raw in loader:
        batch = split(to_device(as_tree(raw), device), task.labels_key)
        outputs = task.outputs(model, batch)
        totals += task.eval_sums(outputs, batch)
        scores.update(outputs, batch)
    peers.all_reduce(totals)
    found: dict[str, Optional[float]] = {"loss": (totals[0] / totals[1].clamp_min(1)).item()}
    if task.has_accuracy:
        found["accuracy"] = (totals[2] / totals[3]).item() if totals[3] > 0 else None
    return {**found, **scores.compute(peers, device)}
