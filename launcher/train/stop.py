"""Stopping on a signal without losing work: the signal handler only records the request; at the next step
boundary every rank learns whether ANY rank was signalled (one tiny MAX allreduce), so all ranks stop at the
same step, write one checkpoint together and leave. Used for Ctrl-C / SIGTERM / SIGHUP and for Slurm preemption
and timeouts (SIGUSR2), by the built-in trainer's ranks only: a ``script=`` gets the signals itself, as under
torchrun (``rank/script_stop.py``).

A rank that cannot reach a step boundary (stuck in a collective or in user code) must not outlive a SIGTERM /
SIGINT: ``STOP_DEADLINE_S`` after it, the rank writes every thread's stack to its log (that names where it was stuck)
and exits. The deadline timer is started by a watcher thread woken through ``signal.set_wakeup_fd``: Python signal
handlers only run when the main thread returns to Python, which a rank blocked inside a C++ collective never
does. SIGUSR2 (Slurm's warning, ``cluster.signal_delay_s`` ahead) gets no timer: Slurm's own kill follows.
When another rank has already failed (``failing()``: its failure record exists), no stop checkpoint can be agreed,
so the stacks are written and the rank ends at once: a job with one stuck rank fails in seconds, not
``STOP_DEADLINE_S``. Outside the training loop (start-up, evaluation at the end) a termination signal acts at once."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from launcher.base.liveness import STOP_DEADLINE_S
from launcher.group.abort import Abort, wait
from launcher.report.stops import STOP_SIGNALS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stopped:
    """What the trainer returns once every rank stopped at one step on a stop signal, the checkpoint written
    (``signum``: this rank's signal; 0: another rank was signalled)."""

    step: int
    signum: int

    def __str__(self) -> str:
        if self.signum:
            return f"stopped at step {self.step} on {signal.Signals(self.signum).name}"
        return f"stopped at step {self.step} (another rank was signalled)"


class StopRequest:
    def __init__(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        self.signum: Optional[int] = None
        # True once another rank of this attempt has failed (nothing left to agree on); set by the rank's entry
        self.failing: Callable[[], bool] = lambda: False
        self.armed = False  # True while the training loop checks ``agreed()`` at every step
        self.deadline_s = deadline_s
        self._timer: Optional[threading.Timer] = None
        self._agreed = False  # the ranks agreed to stop: writing the checkpoint, no deadline timer any more
        self._signums: tuple[int, ...] = ()
        self._wakeup: Optional[tuple[socket.socket, socket.socket]] = None
        self._lock = threading.Lock()
        self._held = False  # failing: stop signals ignored (``hold``)
        self._asked: Optional[tuple] = None  # agreed(pipelined=True): the question in flight
        self.grow = False  # the last ``agreed``: a machine joins at this step boundary (healing in place)
        # said once before a stop ends the process at once, outside the training loop (torchrun's rank 0, which has
        # no launcher above it: the stop line)
        self.last_words: Callable[[int], None] = lambda signum: None
        self._said, self._said_lock = False, threading.Lock()

    def install(self, *signums: int) -> StopRequest:
        self._signums = signums
        for signum in signums:
            signal.signal(signum, self._record)
        if set(STOP_SIGNALS) & set(signums):  # (what ends a rank; SIGUSR2, Slurm's warning, only asks)
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
            self._wakeup = (reader, writer)
            threading.Thread(target=self._watch, args=(reader,), name="stop-watch", daemon=True).start()
        return self

    def _watch(self, reader: socket.socket) -> None:
        """Sees each signal's number as it arrives, even while the main thread is blocked in C++."""
        while data := reader.recv(64):
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._start_deadline(signum)

    def hold(self) -> None:
        """This rank is failing and ending: from now on stop signals are ignored (main thread only), so the
        launcher stopping the job cannot cut its failure record short; the launcher kills it if it does not end."""
        with self._lock:
            self._held = True
        for signum in self._signums:
            signal.signal(signum, signal.SIG_IGN)

    def _start_deadline(self, signum: int) -> None:
        """Armed: stop at the next step boundary, or after ``deadline_s`` with the stacks. Not armed (start-up, the
        evaluation at the end): nothing to checkpoint, so end now, even while the main thread is blocked in C++
        (joining the group, a collective) where the Python handler would not run."""
        with self._lock:
            if self._held or (self._agreed and not self.armed):  # (stopped with a checkpoint: it ends by itself)
                return
            if not self.armed:
                self._say_last(signum)
                sys.stderr.flush()
                os._exit(128 + signum)
            if self._timer is None and not self._agreed:
                deadline_s = 0.0 if self.failing() else self.deadline_s
                self._timer = threading.Timer(deadline_s, self._expire, args=(signum, deadline_s))
                self._timer.daemon = True
                self._timer.start()

    def _say_last(self, signum: int) -> None:
        with self._said_lock:  # (the watcher thread and the handler may both see the signal)
            said, self._said = self._said, True
        if not said:
            self.last_words(signum)

    def uninstall(self) -> None:
        """Default actions again: a later signal (the agent's, after our checkpoint) ends the process at once."""
        self.disarm()
        for signum in self._signums:
            signal.signal(signum, signal.SIG_IGN if self._held else signal.SIG_DFL)
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            self._wakeup[1].close()  # the watcher's recv returns b"" and it ends
            self._wakeup = None

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        with self._lock:
            self.armed = False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _record(self, signum: int, frame: object) -> None:
        if self._held:
            return
        if not self.armed and self._agreed:  # stopped with a checkpoint: the rank says so and ends by itself
            return
        if not self.armed and signum in STOP_SIGNALS:
            self.uninstall()  # nothing to checkpoint yet (or any more): stop now, as without a handler
            self._say_last(signum)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    def _expire(self, signum: int, deadline_s: float) -> None:
        why = (
            f"did not reach a step boundary within {deadline_s:.0f} s of {signal.Signals(signum).name}"
            if deadline_s
            else f"was stopped by {signal.Signals(signum).name} after another rank failed, before reaching a step "
            "boundary"
        )
        print(
            f"launcher: rank {why} (stuck in a collective or in the model?); stacks:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(128 + signum)

    def agreed(
        self, device: torch.device, pipelined: bool = False, growing: bool = False, abort: Optional[Abort] = None
    ) -> bool:
        """Collective: True on every rank if any rank was signalled (the deadline timer stops: we are leaving).
        ``pipelined``: this step's question is sent without waiting and the previous step's answer returned (the
        stop comes one step later, on every rank alike): a blocking collective here would wait behind the buckets
        still in flight under the forward overlap and hide nothing. ``growing``: this rank saw a machine ready to
        join (healing in place); afterwards ``grow`` says whether any rank did (then all leave the round here).
        ``abort``: a lost machine's signal (healing in place): PeerLost instead of a wait for the dead."""
        flag = torch.tensor([1.0 if self.signum else 0.0, 1.0 if growing else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
            if pipelined:
                previous, self._asked = self._asked, (work, flag)
                if previous is None:
                    return False
                work, flag = previous
            wait(work, abort)
        stopping, self.grow = bool(flag[0].item()), bool(flag[1].item())
        if stopping:
            with self._lock:
                self._agreed = True
                if self._timer is not None:
                    self._timer.cancel()
        return stopping
