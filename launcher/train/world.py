"""One round's world: what holds the ranks of the current process group together. The gradient sync (its groups,
its measured strategy and bucket layout) and this rank's loaders (its share of the same global batches). Built at
the start, and again when the job heals in place (the ranks and links changed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from launcher.base.env import DistEnv
from launcher.comm.sync import Sync
from launcher.config import JobConfig
from launcher.config.rules import whole_gradient_reason
from launcher.group.helpers import Peers
from launcher.train.data import ResumableSampler, eval_loader, train_loader
from launcher.train.sync import build_sync


@dataclass
class World:
    sync: Sync
    train_loader: DataLoader
    sampler: ResumableSampler  # the train loader's: each epoch's order, started part-way on resume
    test_loader: Optional[DataLoader]
    batch_per_rank: int

    @classmethod
    def build(
        cls,
        job: JobConfig,
        env: DistEnv,
        device: torch.device,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: tuple[Dataset, Optional[Dataset]],
        global_batch: int,
        peers: Peers,
        kept: dict[str, Any],
    ) -> World:
        """Collective (the sync measures the links). ``kept``: the checkpoint's strategy and bucket cap, which a
        resumed run keeps (the same summation order, bit for bit); empty on another world size; ``healed`` after a
        heal."""
        t = job.train
        sync = build_sync(
            model,
            env,
            device,
            job.comm,
            optimizer,
            resumed_hierarchical=kept.get("hierarchical"),
            resumed_cap_mb=kept.get("bucket_cap_mb"),
            resumed_compression=kept.get("compression"),
            healed=kept.get("healed", False),
            whole_gradient=whole_gradient_reason(t, job.optim),
            peers=peers,
        )
        per_rank = global_batch // env.world_size
        workers, pin = job.data.num_workers, device.type == "cuda"
        train_set, test_set = data
        loader = train_loader(train_set, per_rank, env.rank, env.world_size, t.seed, workers, pin)
        assert isinstance(loader.sampler, ResumableSampler)
        return cls(
            sync=sync,
            train_loader=loader,
            sampler=loader.sampler,
            test_loader=eval_loader(test_set, max(256, per_rank), env.rank, env.world_size, workers, pin),
            batch_per_rank=per_rank,
        )
