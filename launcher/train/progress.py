"""Where training stands: the position a checkpoint resumes from, the job's span in steps, the loop's running
totals, and how a round of the loop ends (``RoundEnd``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from launcher.config import JobConfig
from launcher.heal.protocol import Decision
from launcher.train.stop import Stopped


@dataclass
class Position:
    """What the next step is (saved in every checkpoint)."""

    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # batches of the current epoch already done


@dataclass(frozen=True)
class Span:
    """The job's shape in steps. The LR schedule spans the steps the run takes (``optim.schedule_steps`` when
    given: a run stopped at N steps and extended to 2N then follows the 2N-step run bit for bit). A rank joining
    a running job takes ``global_batch`` and ``steps_per_epoch`` from the ranks it joins."""

    global_batch: int
    steps_per_epoch: int
    total_steps: int  # the steps the run takes: the epochs, or train.max_steps when fewer
    schedule_steps: int  # the LR schedule's span

    @classmethod
    def of(cls, job: JobConfig, global_batch: int, steps_per_epoch: int) -> Span:
        t = job.train
        epochs_steps = t.epochs * steps_per_epoch
        total = min(t.max_steps or epochs_steps, epochs_steps)
        return cls(global_batch, steps_per_epoch, total, job.optim.schedule_steps or total)


@dataclass
class Totals:
    """The loop's running totals, kept across a heal in place (a healed round takes the highest of every rank's)."""

    window: torch.Tensor  # since the last log: loss sum, batches, exposed communication s
    window_t0: float = field(default_factory=time.perf_counter)
    trained_steps: int = 0
    last_eval_epoch: int = -1
    final_loss: float = math.nan
    evaluated: Optional[dict[str, Optional[float]]] = None  # the last evaluation: loss, accuracy, train.metrics
    logged_step: int = -1
    saved_step: int = -1  # the step of the newest checkpoint this run wrote in the loop

    @classmethod
    def on(cls, device: torch.device) -> Totals:
        return cls(window=torch.zeros(3, dtype=torch.float64, device=device))

    def counts(self) -> tuple[int, int, int]:
        return self.logged_step, self.saved_step, self.trained_steps

    def take_highest(self, every_rank: list[tuple[int, int, int]]) -> None:
        """After a heal: the counts of the rank furthest on (ranks may differ by the step some were ahead)."""
        self.logged_step, self.saved_step, self.trained_steps = (max(c) for c in zip(*every_rank))


@dataclass(frozen=True)
class Finished:
    """Every step trained, the last evaluation and checkpoint written."""


@dataclass(frozen=True)
class Lost:
    """A machine was lost under the round: the survivors go on in the round after ``decision``."""

    decision: Decision


@dataclass(frozen=True)
class Grows:
    """The ranks agreed to leave the round at this step: a machine joins in the round after ``decision``."""

    decision: Decision


@dataclass(frozen=True)
class Left:
    """This rank is out of the job (declared lost while it ran, or the job ended before it could join)."""

    why: str


RoundEnd = Union[Finished, Stopped, Lost, Grows, Left]  # how a round of the training loop ends
