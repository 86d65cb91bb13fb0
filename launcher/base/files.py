"""Writing run-dir files so that a reader (another rank, node, or the launcher) never sees half of one.

One helper for every such file: write to a fresh temporary file beside the target (``tempfile.mkstemp``: an
unpredictable name, created exclusively, so a link planted there is never followed), fsync, rename over it (atomic
on POSIX file systems, NFS included), with the permissions the user's umask gives a new file (``run_umask``).

Permissions: every file and folder of a run gets the user's umask, with others' write bit masked (the run dir holds
checkpoints that resume jobs): a user whose umask is 077 gets a run nobody else can read, one whose umask is 022 a run
the team can read. Nothing is chmod'ed wider than the umask allows; a file holding the job's secret is 0600 whatever
the umask (``private_files``). Processes of a job that start under another shell's umask (the ssh hosts', a Slurm
task's) get the head's: ``run_umask`` is what they carry.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

NEW_FILE_MODE = 0o666  # what open() asks for: the umask takes its bits away
NOT_FOR_OTHERS = 0o002  # never writable by others, whatever the umask


def run_umask() -> int:
    """This process's umask with others' write bit added (``NOT_FOR_OTHERS``): the bits every file and folder of a
    run loses. Read from /proc/self/status, not by setting it: ``os.umask`` sets as it reads, and a thread creating a
    file in between would get the mask set meanwhile (without /proc, a private one: tighter, never looser)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o077)
        os.umask(mask)
    return mask | NOT_FOR_OTHERS


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: int = NEW_FILE_MODE, sync: bool = True) -> Iterator[BinaryIO]:
    """A binary file whose content replaces ``path`` in one step (fsync'd unless ``sync=False``: a file rewritten
    every second, whose loss in a crash costs nothing) when the block ends without an error; on an error the
    temporary file is removed and ``path`` is untouched. Its permissions: ``mode`` less the user's umask
    (``run_umask``), as a file the user made with ``open`` would have (``mkstemp`` makes it 0600)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, mode & ~run_umask())
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes, mode: int = NEW_FILE_MODE, sync: bool = True) -> Path:
    """Replace ``path`` with ``data`` in one step; returns the path."""
    with atomic_file(path, mode, sync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any, sync: bool = True) -> Path:
    return write_atomic(path, json.dumps(data, indent=2) + "\n", sync=sync)


def no_world_writable_files() -> None:
    """From now on this process (and what it starts) creates nothing others may write: the run dir holds
    checkpoints that resume jobs. Only the "others" write bit is added to the umask; the user's choice (077: private,
    022: the team reads, 002: a group writes) stays."""
    os.umask(run_umask())


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """While the block runs, this process creates files and folders its owner's only (0600, 0700: umask 077
    added): for files that hold the job's secret, written by a library that takes no mode (submitit's pickled task).
    Only ever tighter than the run's umask: what another thread creates meanwhile is private too, never looser."""
    previous = os.umask(run_umask() | 0o077)
    try:
        yield
    finally:
        os.umask(previous)


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
