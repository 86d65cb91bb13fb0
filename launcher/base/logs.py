"""Rank-aware logging: every rank writes ``logs/rank-<k>.log`` in the run dir; only rank 0 talks to the console.

Ranks other than 0 also send their raw stdout/stderr (prints, warnings, C++ messages) to their log file, so the
console shows one rank's story; a failing rank's traceback still reaches the console through the launcher.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from launcher.base.env import DistEnv
from launcher.base.run_dir import RunDir

FILE_FORMAT = "%(asctime)s %(levelname)s [rank {rank} {host}] %(name)s: %(message)s"
CONSOLE_FORMAT = "[launcher] %(message)s"
console_fd: int | None = None  # a rank other than 0: its console before stdout/stderr went to its log
_talks = {"console": False}  # this process logs to the console (rank 0)


def setup_logging(run_dir: RunDir, env: DistEnv, redirect_output: bool = True) -> Path:
    """Configure the ``launcher`` logger for this rank; returns the rank's log file."""
    path = run_dir.rank_log(env.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("launcher")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(FILE_FORMAT.format(rank=env.rank, host=env.hostname)))
    logger.addHandler(file_handler)
    if env.rank == 0:
        _add_console(logger)
    elif redirect_output:
        global console_fd
        sys.stdout.flush()
        sys.stderr.flush()
        if console_fd is None:
            console_fd = os.dup(2)  # for the watch's stand-in reporter (launcher.watch.reporter)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return path


def take_the_console() -> None:
    """A rank that became rank 0 when the job healed in place: from now on it talks to the console (its raw output
    too), as rank 0 does."""
    if _talks["console"]:  # (tqdm may be standing in for its handler just now)
        return
    if console_fd is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(console_fd, 1)
        os.dup2(console_fd, 2)
    _add_console(logging.getLogger("launcher"))


def _add_console(logger: logging.Logger) -> None:
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    logger.addHandler(console)
    _talks["console"] = True
