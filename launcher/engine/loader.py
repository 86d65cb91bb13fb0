"""An ``Engine``'s training loader: the trainer's (``train/data.py``: a global batch split over the ranks, each sample
at most once per epoch, no padding: the tail that fills no global batch is left out, as on one process), which
follows the engine's position. Iterating it starts the epoch the position is in, part-way when a resume put it
there; each batch handed out counts as done (a checkpoint written in the loop's body resumes after it), and the end
of an epoch moves the position to the next. The global batches are the same on any number of ranks: each epoch's
order is one permutation of the data set (the seed and the epoch), global batch k its k-th slice, each rank's part
of it a stride."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from launcher.train.batch import to_device
from launcher.train.data import ResumableSampler, train_loader
from launcher.train.progress import Position


class EngineLoader:
    def __init__(
        self,
        dataset: Dataset,
        global_batch: int,
        world_size: int,
        rank: int,
        seed: int,
        pos: Position,
        device: torch.device,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                f"engine.loader({type(dataset).__name__}): a map-style data set with __len__ and __getitem__ is "
                "needed (each epoch's order is a permutation of its indices); HINT: an iterable data set keeps its "
                "own order: shard it by rank yourself and use torch's DataLoader"
            )
        if global_batch < world_size or global_batch % world_size:
            raise ValueError(
                f"engine.loader(batch_size={global_batch}): the GLOBAL batch is split evenly over {world_size} "
                f"rank(s); HINT: a multiple of {world_size}, e.g. batch_size={_multiple(global_batch, world_size)}"
            )
        if len(dataset) < global_batch:
            raise ValueError(
                f"engine.loader(batch_size={global_batch}): the data set holds {len(dataset)} samples, not one "
                f"global batch; HINT: batch_size <= {len(dataset) // world_size * world_size or world_size}"
            )
        self.global_batch, self.pos, self.device = global_batch, pos, device
        self._made = (dataset, seed, num_workers, shuffle)
        self.round = 0  # the ranks' round (healing in place): a new one re-splits the batches still to come
        self.before: Optional[tuple[int, int, int]] = None  # (step, epoch, batch) before the last batch handed out
        self.regroup(rank, world_size)
        self.steps_per_epoch = len(self.loader)

    def regroup(self, rank: int, world_size: int) -> None:
        """This rank's part of the same global batches among ``world_size`` ranks (a heal, a machine joining): the
        batch being iterated goes on from the position, re-split."""
        dataset, seed, num_workers, shuffle = self._made
        self.per_rank, pin = self.global_batch // world_size, self.device.type == "cuda"
        self.loader = train_loader(dataset, self.per_rank, rank, world_size, seed, num_workers, pin, shuffle=shuffle)
        assert isinstance(self.loader.sampler, ResumableSampler)
        self.sampler: ResumableSampler = self.loader.sampler
        self.round += 1

    def give_back(self, step: int) -> None:
        """The batch handed out for step ``step + 1`` was not trained (a heal ended that step unapplied): the
        position goes back before it, so it is handed out again (re-split over the ranks of the next round)."""
        if self.before is not None and self.before[0] == step:
            self.pos.epoch, self.pos.batch_in_epoch = self.before[1:]
        self.before = None

    def settle(self) -> None:
        """A position after an epoch's last batch (a checkpoint written there) is the next epoch's start (a resumed
        run's: its loop starts there; a rank joining a running job's is not settled: its loop ends that epoch as
        the others do, ``__iter__``)."""
        if self.pos.batch_in_epoch >= self.steps_per_epoch:
            self.pos.epoch, self.pos.batch_in_epoch = self.pos.epoch + 1, 0

    def __len__(self) -> int:
        """Batches in a whole epoch."""
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        """The epoch the position is in, from its batch; after a heal, on from the (agreed) position over the new
        ranks, until the position leaves this epoch (a rank ahead of this one finished it)."""
        pos = self.pos
        epoch = pos.epoch  # (a position at its end: nothing left of it; ``settle`` moved a resumed one past it)
        while pos.epoch == epoch:
            if pos.batch_in_epoch >= self.steps_per_epoch:
                pos.epoch, pos.batch_in_epoch = epoch + 1, 0
                return
            round_ = self.round
            self.sampler.set_epoch(epoch, skip=pos.batch_in_epoch * self.per_rank)
            for batch in self.loader:
                self.before = (pos.step, pos.epoch, pos.batch_in_epoch)
                pos.batch_in_epoch += 1  # (before the body runs: its checkpoint resumes after this batch)
                yield to_device(batch, self.device)
                if self.round != round_:
                    break  # the ranks changed: the rest of the epoch over the new ones
            else:
                pos.epoch, pos.batch_in_epoch = epoch + 1, 0


def _multiple(batch: int, world_size: int) -> int:
    return max(1, batch // world_size) * world_size
