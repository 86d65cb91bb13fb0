"""Where training stands: the position a checkpoint resumes from, the job's span in steps, the loop's running
totals, and how a round of the loop ends (``RoundEnd``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Union

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
    """The loop's running totals, kept across a heal in place (a healed round takes the highest of every rank's).

    The log's window (the steps since the last train record) is this rank's sums, which the log's allreduce adds;
    a checkpoint holds every rank's part of it (``partial``), and a resume on the same world size continues each
    rank's own (``start``), so the resumed run logs what the uninterrupted one logs (each rank's sums taken in the
    same order: the same loss to the bit). Its time (``step_s``, ``samples_per_s``) is the wall time of its steps
    in each process that ran them: up to the checkpoint, then from the resumed loop's start (the time in between,
    stopped or starting, is not counted). On another world size the window restarts at the resume step. After a
    heal in place the window goes on with the survivors' sums (a joining rank adds none), over the steps and the
    time every rank agreed on (``take_highest``)."""

    window: torch.Tensor  # this rank's since the last log: loss sum, batches, exposed communication s (set at the log)
    window_from: int = 0  # the step the window starts after (the last logged one; every rank's the same)
    window_t0: Optional[float] = None  # when the window's time began (perf_counter; None: not training here yet)
    exposed_s: float = 0.0  # this rank's communication waited for in the window
    trained_steps: int = 0
    last_eval_step: int = -1  # the step of the last evaluation (the end evaluates the final model once)
    final_loss: float = math.nan
    evaluated: Optional[dict[str, Optional[float]]] = None  # the last evaluation: loss, accuracy, train.metrics
    logged_step: int = -1
    saved_step: int = -1  # the step of the newest checkpoint this run wrote in the loop

    @classmethod
    def on(cls, device: torch.device) -> Totals:
        return cls(window=torch.zeros(3, dtype=torch.float64, device=device))

    def elapsed_s(self) -> float:
        """The window's time so far (0 before this process trains: a rank waiting to join)."""
        return 0.0 if self.window_t0 is None else time.perf_counter() - self.window_t0

    def restart(self, step: int) -> None:
        """A new window after ``step`` (logged, the start, or resumed on another world size), its time from now."""
        self.window.zero_()
        self.window_from, self.exposed_s = step, 0.0
        self.window_t0 = time.perf_counter()

    def partial(self) -> dict[str, Any]:
        """This rank's part of the window, for a checkpoint."""
        loss, batches, _ = self.window.tolist()
        return {"from_step": self.window_from, "sums": [loss, batches, self.exposed_s], "elapsed_s": self.elapsed_s()}

    def start(self, step: int, saved: Optional[dict[str, Any]] = None) -> None:
        """The loop starts at ``step``: the window goes on from ``saved`` (this rank's ``partial`` in the checkpoint
        it resumes from, on the same world size), or a new one starts."""
        if saved is None:
            self.restart(step)
            return
        loss, batches, self.exposed_s = saved["sums"]
        self.window.copy_(torch.tensor([loss, batches, 0.0], dtype=torch.float64))
        self.window_from = int(saved["from_step"])
        self.window_t0 = time.perf_counter() - float(saved["elapsed_s"])

    def counts(self) -> tuple[int, int, int, int, float]:
        return self.logged_step, self.saved_step, self.trained_steps, self.window_from, self.elapsed_s()

    def take_highest(self, every_rank: list[tuple[int, int, int, int, float]]) -> None:
        """After a heal: the counts of the rank furthest on (ranks may differ by the step some were ahead), the
        window's start and its longest time (a joining rank's is 0)."""
        highest = [max(c) for c in zip(*every_rank)]
        self.logged_step, self.saved_step, self.trained_steps, self.window_from = (int(c) for c in highest[:4])
        self.window_t0 = time.perf_counter() - highest[4]


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
