"""A console that is a pipe whose reader has gone (``python -m launcher export RUN OUT | head -1``, ``--cfg job |
head``, ``--help | head -3``): what is written after that is dropped, the command runs to its end and exits with its
own code, and no traceback is printed (Python's, from the ``print`` that met the closed pipe, or Hydra's, which
catches it inside its ``run_and_report`` and exits 1). The stream's descriptor then points at ``/dev/null``, as
Python's documentation advises (its signal page, "Note on SIGPIPE"): the interpreter's last flush finds nothing to
fail on.

Why not SIGPIPE's default, the way ``yes | head`` ends: a head whose console is a pipe that closes (the ssh session
that started it dropped) must not die in silence mid-job, its nodes left without a head. It goes on: the session's
SIGHUP stops its job as any stop signal does (the ranks checkpoint), and every rank's log keeps what the console
lost. Installed by each command's ``main`` (``cli``, ``help``) for stdout and stderr; torch-free."""

from __future__ import annotations

import io
import os
import sys
from typing import Any


class DroppingWrites(io.RawIOBase):
    """Writes to file descriptor ``fd``; once its reader has gone (EPIPE), ``fd`` points at ``/dev/null`` and what
    is written is dropped."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.dropped = False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        try:
            return os.write(self.fd, data)
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.fd)
            os.close(null)
            self.dropped = True
            return size


def quiet_closed_pipes() -> None:
    """``sys.stdout`` and ``sys.stderr`` (those that are files) as they were, their writes through
    ``DroppingWrites``: same descriptor, encoding, errors and buffering."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
            stream.flush()
        except (AttributeError, OSError, ValueError):  # not a file (a test's capture), or closed: as it is
            continue
        raw = DroppingWrites(fd)
        unbuffered = isinstance(getattr(stream, "buffer", None), io.RawIOBase)  # (python -u, PYTHONUNBUFFERED)
        binary: Any = raw if unbuffered else io.BufferedWriter(raw)  # (a raw writer: what unbuffered stdio wraps too)
        wrapped = io.TextIOWrapper(
            binary,
            encoding=stream.encoding,
            errors=stream.errors,
            line_buffering=stream.line_buffering,
            write_through=getattr(stream, "write_through", False),
        )
        _REPLACED.append(stream)  # kept: one that owns its descriptor would close it when collected
        setattr(sys, name, wrapped)


_REPLACED: list[Any] = []
