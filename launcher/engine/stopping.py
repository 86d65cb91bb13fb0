"""A stop signal in a loop through the engine, as the trainer stops: SIGINT, SIGTERM or SIGHUP to any rank is
recorded; at a step boundary every rank learns whether any rank got one (a tiny MAX all-reduce, its answer read one
step later: it never waits on the step's own work), and every rank stops there together: the engine writes a
checkpoint, closes and ends the script with ``SystemExit(128 + signal)``, so its ``finally`` blocks and ``atexit``
handlers run. The launcher's agent gives the ranks ``cluster.stop_grace_s`` for it, as torchrun gives its workers.

Installed at the loop's first ``Engine.step()``, and only for the signals whose handler is still Python's default:
a script with a handler of its own keeps it (and stops its own way). A second signal while the first waits for a
step boundary acts at once, as Python's default would (a loop that stopped calling ``Engine.step()`` still ends)."""

from __future__ import annotations

import signal
import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

from launcher.group.abort import Abort, wait
from launcher.report.stops import STOP_SIGNALS

DEFAULTS = (signal.SIG_DFL, signal.default_int_handler)


class StopSignals:
    def __init__(self) -> None:
        self.signum = 0  # the first stop signal this rank got (0: none)
        self.agreed = 0  # the signal every rank stops on (0: none yet)
        self._previous: dict[int, Any] = {}
        self._asked: Optional[tuple[Any, torch.Tensor]] = None  # the question in flight (its answer next step)
        self.grow = False  # every rank agreed to leave the round for a machine joining (healing in place)

    def install(self) -> None:
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) in DEFAULTS:
                self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum
            return
        self.uninstall()  # a second one: as Python's default
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(signum)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def stopping(self, device: torch.device, growing: bool = False, abort: Optional[Abort] = None) -> bool:
        """Collective, at a step boundary: True on every rank once any rank's signal is known to all (``agreed``:
        which one). The question goes out now, the previous step's answer is read. ``growing``: this rank saw a
        machine ready to join (healing in place); ``grow`` then says whether any rank did (all leave the round at
        the same boundary). ``abort``: a lost machine's signal (healing in place): ``PeerLost``, no wait."""
        flag = torch.tensor([float(self.signum), float(growing)], device=device)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            self.agreed, self.grow = self.signum, growing
            return bool(self.agreed)
        previous, self._asked = self._asked, (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        if previous is not None:
            wait(previous[0], abort)
            self.agreed, self.grow = int(previous[1][0].item()), bool(previous[1][1].item())
        return bool(self.agreed)

    def left(self, abort: Abort) -> None:
        """Healing in place: the question in flight belonged to the round left (kept: dropped, its work would wait
        for the dead in its destructor); none in the next round yet."""
        if self._asked is not None:
            abort.keep(self._asked)
        self._asked, self.grow = None, False

    def settle(self) -> None:
        """The question in flight answered (before the group closes: no collective left half-done)."""
        if self._asked is not None:
            self._asked[0].wait()
            self._asked = None
