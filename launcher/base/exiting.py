"""Ending processes: a rank without interpreter teardown (``end_process_at_exit``); a process's children."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Optional

_EXIT_CODE: Optional[int] = None
_LAST: list[Callable[[], None]] = []  # run right before the process ends (``at_the_end``)


def at_the_end(hook: Callable[[], None]) -> None:
    """Run ``hook`` as this process ends, after its output is flushed, whether through ``end_process_at_exit`` or
    the interpreter's own exit (logs.py: wait for rank 0's ``tee`` to pass on its last lines)."""
    _LAST.append(hook)
    atexit.register(hook)


def end_process_at_exit(code: int) -> None:
    """Make this process end with ``code`` right after the atexit handlers, skipping interpreter teardown
    (a later call changes the code).

    Why: process groups kept alive by C++ references (torch DDP's reducer holds the world group after
    ``destroy_process_group``) keep their gloo threads running; if one of them is still releasing a finished
    collective's tensors when the interpreter finalises, it needs the GIL, gets its thread cancelled and the
    process dies with std::terminate (SIGABRT) after a successful run (seen 1 in ~20 test runs; pytorch PR
    179291 describes it). Logs and output are flushed first; nothing else is left to do at that point."""
    global _EXIT_CODE
    if _EXIT_CODE is None:
        atexit.register(_end)  # runs first (atexit is last-in, first-out), before teardown begins
    _EXIT_CODE = code


def settle_exit_code(code: object) -> None:
    """The process's final exit code, once known (a sweep decides it after its jobs): if a rank ran in this
    process and asked to end without teardown, it ends with this code."""
    global _EXIT_CODE
    if _EXIT_CODE is not None:
        _EXIT_CODE = code if isinstance(code, int) else (0 if code is None else 1)


def _end() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    for hook in _LAST:
        hook()
    os._exit(_EXIT_CODE or 0)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
