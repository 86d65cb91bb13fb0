"""Ending processes: a rank without interpreter teardown (``end_process_at_exit``); a process's children; worker
processes stopped with a grace (``stop_within``: signalled, waited for, the rest killed)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launcher.base.liveness import KILLED_WAIT_S, STOP_POLL_S

_EXIT_CODE: Optional[int] = None
_LAST: list[Callable[[], None]] = []  # run right before the process ends (``at_the_end``)


def at_the_end(hook: Callable[[], None]) -> None:
    """Run ``hook`` once as this process ends, after its output is flushed, whether through ``end_process_at_exit``
    (then from its end only: the atexit handlers registered after it, a script's, run before) or the interpreter's
    own exit (logs.py: wait for rank 0's ``tee`` to pass on its last lines)."""
    done: list[bool] = []

    def once() -> None:
        if not done:
            done.append(True)
            hook()

    _LAST.append(once)
    if _EXIT_CODE is None:  # (not ending through ``_end``, or not yet: whichever comes first runs it)
        atexit.register(once)


def end_process_at_exit(code: int) -> None:
    """Make this process end with ``code`` right after the atexit handlers registered after this first call (a
    rank's entry calls it first thing: a script's own handlers run, then this end), skipping interpreter teardown
    (a later call changes the code).

    Why: process groups kept alive by C++ references (torch DDP's reducer holds the world group after
    ``destroy_process_group``) keep their gloo threads running; if one of them is still releasing a finished
    collective's tensors when the interpreter finalises, it needs the GIL, gets its thread cancelled and the
    process dies with std::terminate (SIGABRT) after a successful run (seen 1 in ~20 test runs; pytorch PR
    179291 describes it). Logs and output are flushed first; nothing else is left to do at that point."""
    global _EXIT_CODE
    if _EXIT_CODE is None:
        atexit.register(_end)  # runs after the handlers registered later (last-in, first-out), before teardown
    _EXIT_CODE = code


def exit_code() -> Optional[int]:
    """The code this process will end with through ``end_process_at_exit`` (None: it ends the interpreter's way)."""
    return _EXIT_CODE


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


@dataclass(frozen=True)
class GraceEnd:
    """How processes given a grace ended (``stop_within``): each one's exit code (``subprocess``'s: negative for the
    signal that ended it), which were killed, after how long, and what cut the grace short (None: it ran out, or
    every process ended in it)."""

    codes: dict[int, Optional[int]]
    killed: tuple[int, ...]
    waited_s: float
    cut_short: Optional[BaseException] = None


def stop_within(
    procs: Mapping[int, subprocess.Popen], signum: int, grace_s: float, again: Callable[[], bool] = lambda: False
) -> GraceEnd:
    """Send ``signum`` to each of ``procs`` still running (to its process group: elastic starts each worker in a
    session of its own), wait up to ``grace_s`` for all of them to end, then SIGKILL what is left. A second stop
    ends the wait at once: ``again()`` turning true (polled), or an exception raised while waiting (elastic's
    signal handler raises ``SignalException``): the exception is handed back in ``cut_short``, not raised."""
    start = time.monotonic()
    for proc in procs.values():
        if proc.poll() is None:
            _signal_group(proc.pid, signum)
    deadline, cut = start + grace_s, None
    try:
        for proc in procs.values():
            while proc.poll() is None and not again() and (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=min(left, STOP_POLL_S))
    except BaseException as exc:  # noqa: BLE001 - a second signal (elastic raises it anywhere): end them at once
        cut = exc
    waited = time.monotonic() - start
    killed = tuple(key for key, proc in procs.items() if proc.poll() is None)
    for key in killed:
        _signal_group(procs[key].pid, signal.SIGKILL)
    for key in killed:
        with contextlib.suppress(subprocess.TimeoutExpired):  # (a process stuck in the kernel: left behind)
            procs[key].wait(timeout=KILLED_WAIT_S)
    return GraceEnd({key: proc.poll() for key, proc in procs.items()}, killed, waited, cut)


def _signal_group(pid: int, signum: int) -> None:
    """``signum`` to the process group ``pid`` leads, or to ``pid`` alone when it leads none."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
