"""Writing run-dir files so that a reader (another rank, node, or the launcher) never sees half of one.

One helper for every such file: write to a fresh temporary file beside the target (``tempfile.mkstemp``: an
unpredictable name, created exclusively, so a link planted there is never followed), fsync, rename over it (atomic
on POSIX file systems, NFS included), with permissions set explicitly rather than left to the caller's umask.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

FILE_MODE = 0o644  # readable by the team, writable by the owner only, whatever the umask


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: int = FILE_MODE, sync: bool = True) -> Iterator[BinaryIO]:
    """A binary file whose content replaces ``path`` in one step (fsync'd unless ``sync=False``: a file rewritten
    every second, whose loss in a crash costs nothing) when the block ends without an error; on an error the
    temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes, mode: int = FILE_MODE, sync: bool = True) -> Path:
    """Replace ``path`` with ``data`` in one step; returns the path."""
    with atomic_file(path, mode, sync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any, sync: bool = True) -> Path:
    return write_atomic(path, json.dumps(data, indent=2) + "\n", sync=sync)


def no_world_writable_files() -> None:
    """From now on this process (and what it starts) creates nothing others may write: the run dir holds
    checkpoints that resume jobs. Only the "others" write bit is masked; a site's group-write policy stays."""
    os.umask(os.umask(0) | 0o002)


def remove_empty_dirs(root: str | Path) -> None:
    """Every empty directory under ``root`` (and ``root`` when it ends up empty), deepest first: torch elastic makes
    a folder per rank and attempt for logs the launcher redirects elsewhere; a run leaves none of them empty. Another
    node's agent may clean the same shared folder meanwhile (machines started by hand): what vanishes mid-walk is
    skipped (``os.walk`` ignores it; a glob raised FileNotFoundError and failed a finished job)."""
    for path, _, _ in os.walk(root, topdown=False):
        try:
            os.rmdir(path)
        except OSError:  # not empty (an error file a failed rank left), or gone
            pass


def read_bytes(path: str) -> bytes:
    """A small file's bytes with three system calls and no ``Path`` (the watch reads one per rank each second)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
