"""``summary.json``: what a finished run reports, one typed record shared by the trainer (writes it), the launcher's
end table, sweeps and plots (read it)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from launcher.base.files import write_json_atomic
from launcher.base.run_dir import RunDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    world_size: int
    nodes: int
    procs_per_node: int
    backend: str
    device: str
    reducer: str
    hierarchical: bool  # the strategy actually used, also under comm.hierarchical=auto
    hierarchical_reason: str
    model: str
    data: str
    epochs: int
    steps: int
    global_batch: int
    final_loss: float
    test_accuracy: Optional[float]  # cross-entropy's share of labels right (None: no test split, or another loss)
    samples_per_s: Optional[float]
    wall_s: float
    resumed_from: Optional[str]  # the checkpoint this run resumed from
    hosts: list[str] = field(default_factory=list)  # each node's host name, in node order
    membership: list[dict[str, Any]] = field(default_factory=list)  # machines lost / joined (launcher.base.membership)
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # slow ranks the watch named (launcher.watch)
    precision: str = "fp32"  # train.precision
    accumulate_steps: int = 1  # train.accumulate_steps
    clip_grad_norm: Optional[float] = None  # optim.clip_grad_norm
    loss: str = "cross_entropy"  # train.loss
    skipped_steps: int = 0  # fp16: steps the gradient scaler skipped (inf/nan gradients), this run
    steps_per_epoch: int = 0  # the optimiser steps of one epoch (with ``steps``: how much of the data was seen)
    compression: str = "none"  # what crossed nodes compressed (comm.compress as it applied: one node, none)
    test_loss: Optional[float] = None  # the last evaluation's loss: the mean over every held-out sample
    test_metrics: dict[str, Optional[float]] = field(default_factory=dict)  # its accuracy and train.metrics, by name

    def __post_init__(self) -> None:
        object.__setattr__(self, "reducer", str(self.reducer))  # comm.reducer's member as the text it is

    @property
    def scores(self) -> dict[str, Optional[float]]:
        """The last evaluation's metrics by name (a summary older than ``test_metrics``: its accuracy)."""
        return self.test_metrics or ({"accuracy": self.test_accuracy} if self.test_accuracy is not None else {})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunSummary:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def write(self, run_dir: RunDir) -> Path:
        return write_json_atomic(run_dir.summary, self.to_json())

    @classmethod
    def read(cls, run_dir: RunDir) -> Optional[RunSummary]:
        """The run's summary, or None when it has none (not finished) or it cannot be read (logged)."""
        path = run_dir.summary
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and "steps" not in data:
                return None  # a job's part only (a script's, a failed run's): no training to summarise
            return cls.from_json(data)
        except (OSError, ValueError, TypeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
            return None


@dataclass(frozen=True)
class JobSummary:
    """What every job's ``summary.json`` says, whatever its entry (a ``script=`` too): written by the head at the
    end (rank 0 under torchrun), beside the training's ``RunSummary`` when rank 0 wrote one in this run."""

    entry: str  # what ran: "train.py --lr 0.1", "train LeNet on digits", "doctor"
    world_size: int
    nodes: int
    procs_per_node: int
    hosts: list[str]  # each node's host name, in node order (the last attempt's)
    wall_s: float  # the head's: from the start to the end of every attempt
    exit: int  # the job's exit code
    attempts: list[dict[str, Any]]  # launcher.report.attempts.attempts: one record per attempt

    def write(self, run_dir: RunDir, since: float) -> Path:
        """Into ``summary.json``: the training's summary when rank 0 wrote it after ``since`` (its layout, hosts
        and wall time are the training's own), and this."""
        training: dict[str, Any] = {}
        path = run_dir.summary
        try:
            if path.stat().st_mtime >= since:
                training = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            if path.exists():
                log.warning("rewriting %s: %s", path, exc)
        job = asdict(self)
        return write_json_atomic(path, {**job, **training, **{k: job[k] for k in ("entry", "exit", "attempts")}})
