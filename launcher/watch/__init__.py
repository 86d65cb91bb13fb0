"""The progress watch: names the rank that holds a job up (stuck, desynced, or slow) while every rank is alive, in
every mode and entry (local, sim, ssh, Slurm, by hand, torchrun; the trainer and ``script=``).

Built on torch's flight recorder (``recorder.py``, the only torch side): a thread in every rank publishes what it
says each beat (``publisher.py``); rank 0's thread compares (``reporter.py``: names hangs at ``comm.hang_warn_s``,
ends them at ``comm.timeout_s``, names stragglers) with the pure rules of ``verdict.py``. The user's code is not
touched: no wrapper around its collectives, no hook in its loop (the trainer only tells the watch its step).

Reading map: ``start_watch`` (from ``rank.work``) -> ``Watch.run``: ``Publisher.beat`` + ``Publisher.answer`` every
``WATCH_BEAT_S``, then ``Reporter.tick`` on rank 0 (rank 1 stands in while rank 0 is silent).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from launcher.base.env import DistEnv
from launcher.base.liveness import WATCH_BACKSTOP_S, WATCH_BEAT_S
from launcher.base.run_dir import RunDir
from launcher.config import collective_timeout_s
from launcher.watch import recorder
from launcher.watch.publisher import Publisher
from launcher.watch.reporter import Reporter

log = logging.getLogger(__name__)


def backstop_s(comm: Any) -> float:
    """The trainer's process-group timeout: with the watch on, it ends a hang at ``comm.timeout_s`` (culprit
    named first); a timed-out collective counts as completed in the flight recorder, so torch's own timeout
    comes ``WATCH_BACKSTOP_S`` later, as a backstop for a watch that could not act."""
    return collective_timeout_s(comm) + (WATCH_BACKSTOP_S if comm.hang_warn_s > 0 else 0)


class Watch(threading.Thread):
    def __init__(
        self,
        run_dir: RunDir,
        env: DistEnv,
        warn_s: float,
        timeout_s: Optional[float],
        round_: int = 0,
        left: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(name="launcher-watch", daemon=True)
        self.args = (run_dir, warn_s, timeout_s)
        self.publisher = Publisher(run_dir, env, round_, left)
        reports = env.rank in (0, 1)
        self.reporter = Reporter(run_dir, env, self.publisher.dir, warn_s, timeout_s, round_) if reports else None
        self.halt = threading.Event()
        self.failed = False

    def run(self) -> None:
        while not self.halt.wait(WATCH_BEAT_S):
            began = time.perf_counter()
            try:
                self.publisher.beat(with_arrivals=True)
                self.publisher.answer(threading.get_ident())
                if self.reporter is not None:
                    self.reporter.tick(time.time_ns())
            except Exception:  # the watch must never take a rank down; say it once
                if not self.failed:
                    log.exception("the progress watch failed a beat (it goes on)")
                self.failed = True
            self.publisher.busy_s += time.perf_counter() - began  # its cost: bench/watch.py

    def end(self, how: str) -> None:
        """The rank's work ended (``how``: returned / raised ...): stop, and say so in the last progress."""
        self.halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)
        self.publisher.ended = how
        try:
            self.publisher.beat(with_arrivals=False)
        except Exception:  # the recorder is gone with the process group: the last progress stands
            pass


class ProgressWatch:
    """One rank's progress watch over its rounds, owned by its work (``rank.work``) and handed to the trainer; it
    does nothing for a single rank or ``comm.hang_warn_s=0``. Healing in place starts a new round's watch
    (``rebase``)."""

    def __init__(self, current: Optional[Watch] = None) -> None:
        self._current = current

    def note_step(self, step: int) -> None:
        """The trainer's step (the straggler report says from which step)."""
        if self._current is not None:
            self._current.publisher.note_step(step)

    def known_groups(self) -> frozenset[str]:
        """The process groups this rank has had so far (healing in place: taken before it leaves them, so the next
        round's watch leaves out exactly these, and reads every group formed after)."""
        return frozenset(recorder.group_ids()) if not recorder.MISSING else frozenset()

    def rebase(self, env: DistEnv, round_: int, left: frozenset[str]) -> None:
        """Healing in place: watch round ``round_`` as ``env`` (this rank's new place), every group but the ``left``
        ones (``known_groups`` before the round formed: their open collectives are not a hang)."""
        if self._current is None:
            return
        run_dir, warn_s, timeout_s = self._current.args
        self._current.end("left for the next round")
        self._current = None
        if env.world_size >= 2:
            self._current = Watch(run_dir, env, warn_s, timeout_s, round_, left)
            self._current.start()

    def stragglers(self) -> list[dict[str, Any]]:
        """The stragglers named in this run so far (rank 0): for ``summary.json``."""
        if self._current is None or self._current.reporter is None:
            return []
        return [dict(event) for event in self._current.reporter.stragglers.events]

    def end(self, how: str) -> None:
        """The rank's work ended (the watch now running, after any rebase)."""
        if self._current is not None:
            self._current.end(how)


def start_watch(
    run_dir: RunDir, env: DistEnv, warn_s: float, timeout_s: Optional[float], entries: int
) -> ProgressWatch:
    """Size the flight recorder (before the rank's first process group) and start the watch thread (a watch that
    does nothing for a single rank or ``comm.hang_warn_s=0``)."""
    recorder.enable(entries)
    if env.world_size < 2 or warn_s <= 0:
        return ProgressWatch()
    if recorder.MISSING:
        if env.rank == 0:
            log.warning("%s", recorder.MISSING)
        return ProgressWatch()
    current = Watch(run_dir, env, warn_s, timeout_s)
    current.start()
    return ProgressWatch(current)
