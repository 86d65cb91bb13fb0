"""Writing run-dir files so that a reader (another rank, node, or the launcher) never sees half of one.

One helper for every such file: write to a temporary name beside the target, fsync, rename over it (atomic on
POSIX file systems, NFS included), with permissions set explicitly rather than left to the caller's umask.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILE_MODE = 0o644  # readable by the team, writable by the owner only, whatever the umask


def write_atomic(path: str | Path, data: str | bytes, mode: int = FILE_MODE) -> Path:
    """Replace ``path`` with ``data`` in one step; returns the path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        view = memoryview(raw)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return path


def write_json_atomic(path: str | Path, data: Any) -> Path:
    return write_atomic(path, json.dumps(data, indent=2) + "\n")
