"""The model every rank builds: the same seed on every rank gives the same initial weights, checked across ranks
(a seeding bug would otherwise train garbage silently); sharded under ``comm.reducer=fsdp`` (``shard``, called by the
sharded state before the optimizer is built: the shards are slices of that one init); then evaluation on the
held-out split."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch
from hydra.utils import instantiate
from torch import nn

from launcher.base.devices import seed_all
from launcher.base.env import DistEnv
from launcher.base.sync_modes import Compress
from launcher.comm.shard import ShardSpec, shard_mesh, shard_model
from launcher.config import JobConfig, collective_timeout_s
from launcher.group import helpers as rank_helpers
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


PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def shard(job: JobConfig, env: DistEnv, device: torch.device, model: nn.Module) -> list[str]:
    """The model sharded in place (collective; ``comm/shard.py``; ``comm.reducer=fsdp``'s state:
    ``ShardedState``), its units' names. The forward computes in ``train.precision``'s dtype, gradients are reduced
    and the optimizer steps in fp32."""
    comm = job.comm
    spec = ShardSpec(
        reshard_after_forward=comm.reshard_after_forward,
        unit_classes=tuple(comm.fsdp_units),
        min_params=comm.fsdp_min_params,
        param_dtype=PARAM_DTYPES[job.train.precision],
        scatter_unused=comm.find_unused_parameters or comm.compress in (Compress.powersgd, Compress.auto),
    )
    mesh = shard_mesh(env, comm.shard, device.type, collective_timeout_s(comm))
    return shard_model(model, mesh, spec)


def check_same_weights(model: nn.Module, peers: rank_helpers.Peers = rank_helpers.Peers()) -> None:
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
    peers: rank_helpers.Peers = rank_helpers.Peers(),
    lockstep: bool = False,
) -> dict[str, Optional[float]]:
    """The held-out split's ``loss`` (the mean over every sample), cross-entropy's ``accuracy`` and each metric of
    ``train.metrics`` by its name, over every rank's disjoint share (collective), with rank 0's buffers (batch-norm
    statistics). ``lockstep``: every rank runs as many forwards (a sharded model's gather its parameters)."""
    model.eval()
    peers.broadcast_buffers(model)
    scores.start(device)
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, count, right, count
    rounds = len(loader)  # type: ignore[arg-type]  # (a map-style split)
    if lockstep:  # every rank's forward meets the others' all-gathers: as many as the rank with the most batches
        rounds = int(peers.all_reduce(torch.tensor([rounds], device=device), "max").item())
    batch = None
    for raw in loader:
        batch = split(to_device(as_tree(raw), device), task.labels_key)
        outputs = task.outputs(model, batch)
        totals += task.eval_sums(outputs, batch)
        scores.update(outputs, batch)
        rounds -= 1
    for _ in range(rounds):  # (lockstep: this rank's share ran out; the forward's result is not counted)
        if batch is None:
            raise ValueError(
                "comm.reducer=fsdp: this rank holds no held-out sample while others evaluate theirs (a sharded "
                "forward needs every rank); HINT: a larger test split, or fewer ranks"
            )
        task.outputs(model, batch)
    peers.all_reduce(totals)
    found: dict[str, Optional[float]] = {"loss": (totals[0] / totals[1].clamp_min(1)).item()}
    if task.has_accuracy:
        found["accuracy"] = (totals[2] / totals[3]).item() if totals[3] > 0 else None
    return {**found, **scores.compute(peers, device)}
