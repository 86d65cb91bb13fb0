"""Rank-aware logging: every rank writes ``logs/rank-<k>.log`` in the run dir; only rank 0 talks to the console.

Every rank's raw stdout/stderr (a script's prints, warnings, C++ messages) is in its log file too. Ranks other than
0 send it there only, so the console shows one rank's story (a failing rank's traceback still reaches the console
through the launcher). Rank 0's goes to the console and, through one tee process for both streams (``tee.py``), to its
log file as well: a rank killed by SIGKILL loses nothing it wrote (the ranks run with ``python -u``; the tee drains
the pipes after the rank is gone, in a session of its own, so a signal to the rank's process group does not cut it
short).
The launcher's own log lines go to the file through their handler and to the console straight, not through ``tee``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, TextIO

from tqdm import tqdm

from launcher.base.env import DistEnv
from launcher.base.exiting import at_the_end
from launcher.base.liveness import TEE_DRAIN_S
from launcher.base.run_dir import RunDir

FILE_FORMAT = "%(asctime)s %(levelname)s [rank {rank} {host}] %(name)s: %(message)s"
CONSOLE_FORMAT = "[launcher] %(message)s"
console_fd: int | None = None  # the console before this rank's stdout/stderr went to its log (or through tee)
_talks = {"console": False}  # this process logs to the console (rank 0)
_console: dict[str, TextIO] = {}  # "stream": the console as a text stream (rank 0's log lines, the progress bar)
_tees: list[subprocess.Popen] = []  # rank 0's tee processes


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
    if redirect_output:
        _save_console()
        if env.rank == 0:
            _tee(path, out_fd=os.dup(1))
        else:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # (the umask decides)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
    if env.rank == 0:
        _add_console(logger)
    return path


def _save_console() -> None:
    global console_fd
    sys.stdout.flush()
    sys.stderr.flush()
    if console_fd is None:
        console_fd = os.dup(2)  # the console handler; the watch's stand-in reporter (launcher.watch.reporter)


def _tee(path: Path, out_fd: Optional[int] = None) -> None:
    """This process's stdout and stderr to the console (``out_fd``, ``console_fd``) and appended to ``path``, by one
    process of its own (``launcher/base/tee.py``: the streams apart, their lines whole), in a session of its own."""
    assert console_fd is not None
    out = out_fd if out_fd is not None else console_fd
    pipes = [os.pipe(), os.pipe()]  # stdout's, stderr's: (read, write)
    fds = [pipes[0][0], out, pipes[1][0], console_fd]
    argv = [sys.executable, "-S", "-u", str(Path(__file__).with_name("tee.py")), str(path), *map(str, fds)]
    if not _tees:  # (once: it waits for every tee of this process)
        at_the_end(_drain)
    _tees.append(subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL, start_new_session=True))
    for fd, (read, write) in zip((1, 2), pipes):
        os.close(read)
        os.dup2(write, fd)
        os.close(write)
    if out_fd is not None:
        os.close(out_fd)


def _drain() -> None:
    """This process's last lines reach the console before it ends (whoever reads the console may stop at its
    end): its stdout and stderr closed, each ``tee`` passes on what is left and ends (at most a few seconds)."""
    if not _tees:
        return
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    for tee in _tees:
        with contextlib.suppress(subprocess.TimeoutExpired):
            tee.wait(timeout=TEE_DRAIN_S)
    _tees.clear()


def console_stream() -> TextIO:
    """Rank 0's console as a text stream: its log lines and the progress bar, never into its log file twice."""
    if "stream" not in _console:
        if console_fd is None:
            return sys.stderr
        _console["stream"] = os.fdopen(os.dup(console_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    return _console["stream"]


def take_the_console() -> None:
    """A rank that became rank 0 when the job healed in place: from now on it talks to the console (its raw output
    too), as rank 0 does."""
    if _talks["console"]:  # (tqdm may be standing in for its handler just now)
        return
    if console_fd is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        log_file = logging.getLogger("launcher").handlers[0]
        assert isinstance(log_file, logging.FileHandler)
        _tee(Path(log_file.baseFilename))  # its raw output to the console and its log, as rank 0's
    _add_console(logging.getLogger("launcher"))


class _Console(logging.StreamHandler):
    """Log lines to the console through ``tqdm.write``: above rank 0's progress bar, never through its log file."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def _add_console(logger: logging.Logger) -> None:
    console = _Console(console_stream())
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    logger.addHandler(console)
    _talks["console"] = True
