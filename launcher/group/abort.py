"""The abort signal of one rank's collectives: leaving a collective whose peers are gone without waiting for them.

Healing in place (``launcher.heal``) hands one ``Abort`` to whatever waits on a collective (the sync engine's
buckets and hooks, the stop agreement, the object collectives); it knows nothing of healing, and code handed None
waits as it always did.

What gloo allows (torch 2.13, measured): a peer that was killed resets its connections, and the collectives of its
ring neighbours fail within milliseconds; a peer that froze or lost its link sends nothing, and every survivor
waits until the group's timeout. ``ProcessGroup.abort()``, ``shutdown()`` and ``destroy_process_group()`` return at
once but leave a thread blocked in a collective blocked, and a survivor that is not a ring neighbour of the lost
rank gets no error at all. So a collective that may outlive a peer is started with ``async_op=True`` and waited for
through ``abortable``: a future of our own that completes with the backend's, or fails with ``PeerLost`` the moment
``trip()`` is called. The abandoned work is kept until the process ends (``keep``: dropped, it would block in its
destructor until the old group's timeout)."""

from __future__ import annotations

import threading
from typing import Any, Optional, Protocol

from torch.futures import Future

from launcher.base.errors import Kind, LauncherError


class Cause(Protocol):
    """What tripped the abort, handed on in every ``PeerLost`` it causes (healing in place: the keeper's decision,
    ``launcher.heal.protocol.Decision``; this layer only carries it)."""

    def said(self) -> str: ...


class PeerLost(LauncherError):
    """A collective was left because a machine of the job is gone (``str``: who said so, and why; ``cause``: what
    the one who tripped the abort handed it, for healing the keeper's decision). Not a ``RuntimeError``: torch's
    futures carry any exception, and no catch of torch's errors may take it for one of them."""

    kind = Kind.peer

    def __init__(self, why: str, cause: Optional[Cause] = None) -> None:
        super().__init__(why)
        self.cause = cause


class Abort:
    """Set once per round (``trip``): every pending and later ``abortable`` future fails with ``PeerLost``, until
    ``next_round``. A word about an earlier round, arriving late, is ignored (``trip(why, round_)``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tripped = threading.Event()
        self._why = ""
        self._cause: Optional[Cause] = None
        self._round = 0
        self._pending: dict[int, tuple[Future, Future]] = {}  # id(ours) -> (ours, the backend's)
        self._kept: list[Any] = []  # left groups, their works, the objects holding them: kept until the end

    @property
    def round(self) -> int:
        return self._round

    def is_set(self) -> bool:
        return self._tripped.is_set()

    def reason(self) -> str:
        return self._why or "a machine of this job is gone"

    def keep(self, thing: Any) -> None:
        """Keep ``thing`` (a left group, a work, a left sync) referenced until the process ends."""
        self._kept.append(thing)

    def trip(self, why: str, round_: Optional[int] = None, cause: Optional[Cause] = None) -> None:
        """A machine is gone: every pending ``abortable`` future fails with ``PeerLost(why, cause)``, and so does
        every later one, until ``next_round``. ``round_``: only if this rank is still in that round."""
        with self._lock:
            if self._tripped.is_set() or round_ not in (None, self._round):
                return
            self._why, self._cause = why, cause
            self._tripped.set()
            pending = list(self._pending.values())
            self._pending.clear()
        for ours, theirs in pending:
            self._kept.append(theirs)
            ours.set_exception(PeerLost(why, cause))

    def next_round(self) -> None:
        """A new round: nothing is lost in it yet."""
        with self._lock:
            self._why, self._cause = "", None
            self._tripped.clear()
            self._round += 1

    def lost_within(self, grace_s: float) -> Optional[PeerLost]:
        """The loss of a machine, when the abort trips within ``grace_s`` (0: tripped already): a collective's
        backend error may come first (a peer killed resets its connections before anyone has declared it lost), so
        the caller holding one asks here. None: no machine was lost meanwhile."""
        if not self._tripped.wait(grace_s):
            return None
        with self._lock:
            return PeerLost(self.reason(), self._cause)

    def abortable(self, theirs: Future) -> Future:
        """A future that completes with ``theirs`` (a collective's) or fails with ``PeerLost`` once tripped."""
        ours: Future = Future()
        with self._lock:
            if self._tripped.is_set():
                self._kept.append(theirs)
                ours.set_exception(PeerLost(self.reason(), self._cause))
                return ours
            self._pending[id(ours)] = (ours, theirs)

        def done(future: Future) -> None:
            with self._lock:
                if self._pending.pop(id(ours), None) is None:
                    return  # already failed by trip()
            try:
                ours.set_result(future.value())
            except Exception as exc:  # the backend's own error (a killed peer's reset connection)
                ours.set_exception(exc)

        theirs.add_done_callback(done)
        return ours


def abortable(future: Future, abort: Optional[Abort]) -> Future:
    """``future`` itself without an abort signal (no Python callback per bucket: bench/reducer.py), else
    ``abort.abortable(future)``."""
    return future if abort is None else abort.abortable(future)


def wait(work: Any, abort: Optional[Abort]) -> Any:
    """Wait for an ``async_op=True`` collective's ``work``: its result, its own error, or ``PeerLost``."""
    return work.wait() if abort is None else abort.abortable(work.get_future()).wait()
