"""Checkpoint names, and which is newest: no torch here, so the head (``launch/nodes/restarts.py``, the stop line)
reads them as the trainer (``launcher.train.saving``) writes them.

A replicated job's checkpoint is one file, ``checkpoints/step-XXXXXXXX.pt``; a sharded job's (``comm.reducer=fsdp``)
is a directory ``checkpoints/step-XXXXXXXX/`` every rank writes its shard into (torch.distributed.checkpoint). Such
a directory is written as ``step-XXXXXXXX.tmp/`` and renamed once whole, and it counts only with DCP's ``.metadata``
(written last, by DCP's coordinator) and rank 0's ``train.pt``: a write cut short (a crash, a full disk) never
becomes the newest checkpoint, whatever a file system does with the rename."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

_NAME = re.compile(r"step-(\d+)(\.pt)?")  # (matched whole: ``step-N.tmp``, ``step-N.old``, ``x-step-N.pt`` are not)
DCP_METADATA = ".metadata"  # DCP's own name for the file that makes a directory a checkpoint
TRAIN_STATE = "train.pt"  # a sharded checkpoint's position, schedule and config (rank 0; not the model's)
WRITING, REPLACED = ".tmp", ".old"  # a sharded checkpoint being written; one being replaced by another of its step
_CUT_SHORT = re.compile(rf"step-(\d+)({re.escape(WRITING)}|{re.escape(REPLACED)})")


def checkpoint_path(directory: Path, step: int) -> Path:
    """A replicated job's checkpoint file at ``step``."""
    return directory / f"step-{step:08d}.pt"


def sharded_path(directory: Path, step: int) -> Path:
    """A sharded job's checkpoint directory at ``step``."""
    return directory / f"step-{step:08d}"


def rank_state(path: Path, rank: int) -> Path:
    """Rank ``rank``'s own part of the sharded checkpoint ``path``: its RNG, log window and compression state."""
    return path / f"own-{rank}.pt"


def is_sharded(path: Path) -> bool:
    return path.is_dir()


def is_complete(path: Path) -> bool:
    """A checkpoint file, or a sharded checkpoint directory with DCP's metadata and the training state."""
    if path.is_dir():
        return (path / DCP_METADATA).is_file() and (path / TRAIN_STATE).is_file()
    return path.is_file()


def step_of(path: Path) -> Optional[int]:
    """The step in a checkpoint's name; None for any other name."""
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in ``directory`` (files and sharded directories), oldest first (by step)."""
    if not directory.is_dir():
        return []
    found = [(step, p) for p in directory.iterdir() if (step := step_of(p)) is not None and is_complete(p)]
    return [p for _, p in sorted(found)]


def leftovers(directory: Path, upto: Optional[int] = None) -> list[Path]:
    """Sharded checkpoints' directories a write or a replacement cut short left behind (``.tmp``, ``.old``); ``upto``:
    only those of that step or before (a later one may be a write under way)."""
    if not directory.is_dir():
        return []
    found = [(p, m) for p in directory.iterdir() if (m := _CUT_SHORT.fullmatch(p.name))]
    return [p for p, m in found if upto is None or int(m.group(1)) <= upto]


def newest(directory: Path) -> Optional[Path]:
    """The newest complete checkpoint in ``directory``, None when there is none."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def newest_step(directory: Path) -> Optional[int]:
    """The step of the newest checkpoint in ``directory`` (by its name), None when there is none."""
    path = newest(directory)
    return step_of(path) if path is not None else None
