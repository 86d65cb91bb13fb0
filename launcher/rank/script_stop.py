"""A ``script=`` rank's stop signals, as torchrun leaves them to its workers: SIGINT, SIGTERM and SIGHUP reach the
script itself, its own handlers or Python's defaults (SIGINT raises ``KeyboardInterrupt``, SIGTERM and SIGHUP end the
process), and the rank's agent gives it ``cluster.stop_grace_s`` to exit before it kills it
(``launch/nodes/elastic.py``). The launcher installs no handler of its own for them and never ends the script
early; it only notes which one arrived (``ScriptSignals``: Python's C-level handler writes each signal it catches to
the wakeup fd, whoever's Python handler then runs), so that a script that ends after one ended on a stop, never a
failure: its own exit code (0 for one that saved and exited), 130 for a Ctrl-C it did not handle
(``rank.entry``), and how it ended recorded for the stop line (``report.stops.RankEnd``).

Slurm's warning ahead of a preemption or the time limit (SIGUSR2, ``cluster.signal_delay_s``) is the launcher's own:
``warned`` runs in a thread of its own (rank 0 requeues the job: Slurm's SIGTERM then gives the script its KillWait
to save and exit), unless the script installs a handler for SIGUSR2 itself."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable
from typing import Optional

from launcher.base.liveness import WARNING_DONE_S
from launcher.report.stops import STOP_SIGNALS


class ScriptSignals:
    """Which stop signal reached this process first (``seen``), without a handler of the launcher's for it; a
    handler for each of ``warnings`` that starts ``warned`` (once)."""

    def __init__(self, warnings: tuple[int, ...] = (), warned: Optional[Callable[[], None]] = None) -> None:
        self.warnings, self.warned = warnings, warned
        self.first: Optional[int] = None
        self.warning: Optional[threading.Thread] = None
        self._sockets: Optional[tuple[socket.socket, socket.socket]] = None
        self._previous = -1

    def install(self) -> ScriptSignals:
        reader, writer = socket.socketpair()
        for end in (reader, writer):
            end.setblocking(False)
        try:
            self._previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread: nothing is noted (a stop still ends the script its own way)
            reader.close()
            writer.close()
            return self
        self._sockets = (reader, writer)
        for signum in self.warnings:
            signal.signal(signum, self._warn)
        return self

    def _warn(self, signum: int, frame: object) -> None:
        if self.warned is not None and self.warning is None:
            self.warning = threading.Thread(target=self.warned, name="stop-warning", daemon=True)
            self.warning.start()

    def seen(self) -> Optional[int]:
        """The first stop signal that reached this process so far (None: none did)."""
        if self._sockets is not None:
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                while self.first is None and (data := self._sockets[0].recv(64)):
                    self.first = next((s for s in data if s in STOP_SIGNALS), None)
        return self.first

    def uninstall(self) -> Optional[int]:
        """Stop noting (the wakeup fd as it was, the warnings ignored from now on: the rank is ending); what was
        ``seen``. The warning's work, if one started, is waited for (``WARNING_DONE_S`` at most)."""
        first = self.seen()
        if self._sockets is not None:
            for signum in self.warnings:
                if signal.getsignal(signum) == self._warn:
                    signal.signal(signum, signal.SIG_IGN)
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous)
            for end in self._sockets:
                end.close()
            self._sockets = None
        if self.warning is not None:
            self.warning.join(timeout=WARNING_DONE_S)
        return first
