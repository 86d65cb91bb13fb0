"""A run's file modes (issue 51): every file and folder it leaves has the mode the user's umask gives (others' write
bit masked too), and a file holding the job's secret is its owner's only (0600). ``umask`` runs a job under a mask;
``secrets_seen`` collects the jobs' secrets from the processes' environments while it runs (a rank's, a node
process's: /proc/PID/environ, as root reads it); ``wrong_modes`` names every path whose mode is not the expected one."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from harness.probes import in_background

SECRET_VAR = b"LAUNCHER_SECRET="  # (launcher.trust.secret.SECRET_ENV)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask (so the heads it starts, fresh or forked: harness.heads) for the block."""
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


@contextlib.contextmanager
def secrets_seen() -> Iterator[set[str]]:
    """While the block runs, every process's environment on this host (simulated nodes and the ssh machines too: one
    kernel) is read every 100 ms; yields the set of job secrets (hex) found in them."""
    found: set[str] = set()
    done = threading.Event()

    def scan() -> None:
        while not done.wait(0.1):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                with contextlib.suppress(OSError):
                    for var in (proc / "environ").read_bytes().split(b"\0"):
                        if var.startswith(SECRET_VAR):
                            found.add(var[len(SECRET_VAR) :].decode())

    with in_background(scan, done):
        yield found


def expected_mode(path: Path, mask: int) -> int:
    """What ``open`` / ``mkdir`` give a new file or folder under ``mask``, others' write bit always masked."""
    return (0o777 if path.is_dir() else 0o666) & ~(mask | 0o002)


def wrong_modes(run_dir: Path, mask: int, secrets: set[str], private: tuple[Path, ...] = ()) -> list[str]:
    """``path mode (why)`` for each path under ``run_dir`` (itself included) whose mode is not ``expected_mode``: a
    file holding one of ``secrets`` must be 0600 instead, and under a ``private`` folder (one holding such files) every
    folder is 0700 and every file 0600."""
    wrong, needles = [], [s.encode() for s in secrets]
    for path in [run_dir, *sorted(run_dir.rglob("*"))]:
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            continue
        mode, want, why = stat.S_IMODE(info.st_mode), expected_mode(path, mask), f"umask {mask:04o}"
        if any(path == p or p in path.parents for p in private):
            want, why = (0o700 if path.is_dir() else 0o600), "private"
        if path.is_file() and any(n in path.read_bytes() for n in needles):
            want, why = 0o600, "holds the job's secret"
        if mode != want:
            wrong.append(f"{path.relative_to(run_dir.parent)} {mode:04o} ({why}: {want:04o})")
    return wrong
