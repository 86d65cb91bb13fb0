"""Checkpoint file names, ``checkpoints/step-XXXXXXXX.pt``, and which is newest: no torch here, so the head
(``launcher.heal.membership``) reads them as the trainer (``launcher.train.checkpoint``) writes them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

_NAME = re.compile(r"step-(\d+)\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoints in ``directory``, oldest first (by step)."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.search(p.name))]
    return [p for _, p in sorted(found)]


def newest_step(directory: Path) -> Optional[int]:
    """The step of the newest checkpoint in ``directory`` (by its name), None when there is none."""
    found = list_checkpoints(directory)
    match = _NAME.search(found[-1].name) if found else None
    return int(match.group(1)) if match else None
