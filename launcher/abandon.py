"""Leaving a collective whose peers are gone, without waiting for them (healing in place: a lost machine's survivors
go on without a restart; ``rendezvous.next_round`` forms their next process group, ``launcher.train.heal`` drives it).

What gloo allows (torch 2.13, measured): a peer that was killed resets its connections, and the collectives of its
ring neighbours fail within milliseconds; a peer that froze or lost its link sends nothing, and every survivor
waits until the group's timeout. ``ProcessGroup.abort()``, ``shutdown()`` and ``destroy_process_group()`` return at
once but leave a thread blocked in a collective blocked, and a survivor that is not a ring neighbour of the lost
rank gets no error at all. So a collective that may outlive a peer is started with ``async_op=True`` and waited for
through ``abortable``: a future of our own that completes with the backend's, or fails with ``PeerLost`` the moment
``lost()`` is called (by ``watch_store``, which polls the keeper's store for its decision; a rank whose own
collective failed first, its peer's connection reset, waits for that decision: ``train.heal.Healer.end_of_round``).
The abandoned work stays referenced until the process ends (``GRAVEYARD``, where ``rendezvous.next_round`` leaves
the broken group too): dropped, either would block in its destructor until the old group's timeout.

``abortable`` only wraps while healing is on (``enable()``, in a rank of a job that heals): elsewhere it returns the
backend's future itself (its Python callback would cost a GIL hand-off per bucket: bench/reducer.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional

from torch.futures import Future

LOST = threading.Event()  # a machine of this round is gone: every abortable wait gives up
POLL_S = 0.05  # how often the store watch looks at the store
GRAVEYARD: list[Any] = []  # left groups, their works and the objects holding them: kept until the process ends
_state: dict[str, Any] = {"enabled": False, "round": 0}  # healing on; the current round (``reset`` counts)
_reason: list[str] = []
_pending: dict[int, tuple[Future, Future]] = {}  # id(ours) -> (ours, the backend's)
_lock = threading.Lock()


class PeerLost(RuntimeError):
    """A collective was left because a machine of the job is gone (``str``: who said so, and why)."""


def enable() -> None:
    """This rank heals in place: from now on ``abortable`` wraps."""
    _state["enabled"] = True


def enabled() -> bool:
    return bool(_state["enabled"])


def reason() -> str:
    return _reason[0] if _reason else "a machine of this job is gone"


def lost(why: str, round_: int | None = None) -> None:
    """Say that a machine is gone: every pending ``abortable`` future fails with ``PeerLost(why)``, and so does
    every later one, until ``reset``. ``round_``: only if this process is still in that round (see ``reset``)."""
    with _lock:
        if LOST.is_set() or round_ not in (None, _state["round"]):
            return
        _reason.append(why)
        LOST.set()
        pending = list(_pending.values())
        _pending.clear()
    for ours, theirs in pending:
        GRAVEYARD.append(theirs)  # dropped, it would block in its destructor until the group's timeout
        ours.set_exception(PeerLost(why))


def reset() -> None:
    """A new round: nothing is lost in it yet (a word about an earlier round, arriving late, is ignored)."""
    with _lock:
        _reason.clear()
        LOST.clear()
        _state["round"] += 1


def abortable(theirs: Future) -> Future:
    """``theirs`` (a collective's future), or, while healing is on, a future that completes with it or fails with
    ``PeerLost`` as soon as ``lost()`` is called."""
    if not _state["enabled"]:
        return theirs
    ours: Future = Future()
    with _lock:
        if LOST.is_set():
            GRAVEYARD.append(theirs)
            ours.set_exception(PeerLost(reason()))
            return ours
        _pending[id(ours)] = (ours, theirs)

    def done(future: Future) -> None:
        with _lock:
            if _pending.pop(id(ours), None) is None:
                return  # already failed by lost()
        try:
            ours.set_result(future.value())
        except Exception as exc:  # the backend's own error (a killed peer's reset connection)
            ours.set_exception(exc)

    theirs.add_done_callback(done)
    return ours


def wait(work: Any) -> Any:
    """Wait for an ``async_op=True`` collective's ``work``: its result, its own error, or (healing) ``PeerLost``."""
    return abortable(work.get_future()).wait() if _state["enabled"] else work.wait()


def watch_store(
    store: Any, key: str, stop: threading.Event, on_key: Callable[[bytes], Optional[str]]
) -> threading.Thread:
    """A daemon thread that calls ``on_key(value)`` when ``key`` appears in ``store`` (until ``stop`` is set; a
    store unreachable for a while, a link down, is asked again), then ``lost`` with what it returns (None: nothing
    is lost, a machine joins)."""

    round_ = _state["round"]

    def run() -> None:
        while not stop.is_set() and not LOST.is_set():
            try:
                if store.check([key]):
                    if (why := on_key(store.get(key))) is not None:
                        lost(why, round_)
                    return
            except RuntimeError:  # unreachable for now
                pass
            stop.wait(POLL_S)

    thread = threading.Thread(target=run, name="heal-watch", daemon=True)
    thread.start()
    return thread
