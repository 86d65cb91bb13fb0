"""What a run leaves behind for people and tools: ``metrics.jsonl`` (one JSON object per logged step or
evaluation), the same records' numbers as TensorBoard scalars in ``tensorboard/`` (``train.tensorboard=true``) and
``summary.json`` at the end. Only rank 0 writes.

TensorBoard: each numeric field of a train or eval record is one scalar at the record's step, tagged
``<kind>/<field>`` (``train/loss``, ``train/lr``, ``train/samples_per_s``, ``eval/accuracy``: an eval record's
``test_`` prefix is dropped). torch's ``SummaryWriter`` (and the tensorboard package behind it) is imported when
rank 0 opens the writer, never at the launcher's start-up."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TextIO

from launcher.base.run_dir import RunDir
from launcher.config.rules import TENSORBOARD_HINT

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class MetricsWriter:
    """Appends JSON lines to ``run_dir/metrics.jsonl`` (a resumed run continues the same file); with
    ``tensorboard``, writes their numbers into ``run_dir/tensorboard/`` too (``TensorBoardWriter``)."""

    def __init__(self, run_dir: RunDir, enabled: bool, tensorboard: bool = False, start_step: int = 0) -> None:
        """``start_step``: the step this run starts from (a resumed run's); TensorBoard drops the events an earlier
        run wrote after it, which this run writes again."""
        run = run_dir
        self.path = run.metrics
        self._file: Optional[TextIO] = None
        self.board = TensorBoardWriter(run.tensorboard) if tensorboard else None
        if enabled:
            self.open(purge_after=start_step)

    def open(self, purge_after: Optional[int] = None) -> None:
        """Start writing (rank 0; a rank that became rank 0 when the job healed in place: ``purge_after`` None, the
        job's events so far stand)."""
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        if self.board is not None:
            self.board.open(None if purge_after is None else purge_after + 1)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self.board is not None:
                self.board.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.board is not None:
            self.board.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numeric fields as TensorBoard tags -> values; ``step`` (the x axis), ``None`` and text skipped."""
    kind = str(record.get("kind", "train"))
    found = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        found[f"{kind}/{key.removeprefix('test_') if kind == 'eval' else key}"] = float(value)
    return found


class TensorBoardWriter:
    """Rank 0's ``SummaryWriter`` on ``folder``, flushed after every record (a killed run keeps what it logged, as
    ``metrics.jsonl`` does); each process writes its own event file there, TensorBoard reads them all."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._writer: Optional[SummaryWriter] = None

    def open(self, purge_step: Optional[int]) -> None:
        """``purge_step``: TensorBoard drops the events earlier writers left at this step and after (None: none)."""
        if self._writer is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # the launcher checked its own machine; this one (a node of the job) lacks it
            raise RuntimeError(
                f"train.tensorboard=true, but torch's TensorBoard support cannot be imported on "
                f"{socket.gethostname()} ({exc}); HINT: {TENSORBOARD_HINT} there, or train.tensorboard=false"
            ) from exc
        self._writer = SummaryWriter(str(self.folder), purge_step=purge_step)

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            return
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=int(record["step"]))
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
