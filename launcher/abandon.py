"""Leaving a collective whose peers are gone, without waiting for them: the first piece of healing in place (a lost
machine's survivors go on without a restart; ``rendezvous.next_round`` forms their next process group).

What gloo allows (torch 2.13, measured): a peer that was killed resets its connections, and the collectives of its
ring neighbours fail within milliseconds; a peer that froze or lost its link sends nothing, and every survivor
waits until the group's timeout. ``ProcessGroup.abort()``, ``shutdown()`` and ``destroy_process_group()`` return at
once but leave a thread blocked in a collective blocked, and a survivor that is not a ring neighbour of the lost
rank gets no error at all. So a collective that may outlive a peer is started with ``async_op=True`` and waited for
here (``wait``), on its future and on ``LOST``: an event set by whoever learns first that a machine is gone (this
rank's own failed collective, or the key ``LOST_KEY`` in the rendezvous store, polled by ``watch_store``). Then
``PeerLost`` is raised, and the abandoned work stays referenced until the process ends (``GRAVEYARD``, where
``rendezvous.next_round`` leaves the broken group too): dropped, either would block in its destructor until the
old group's timeout."""

from __future__ import annotations

import threading
from typing import Any

LOST = threading.Event()  # a machine of this round is gone: every wait gives up
LOST_KEY = "heal/lost"  # in the round's store: why (set once, by whoever knows first)
POLL_S = 0.05  # how often a waiting rank looks at LOST, and the store watch at the store
_reason: list[str] = []
GRAVEYARD: list[Any] = []  # left groups and their works: kept until the process ends


class PeerLost(RuntimeError):
    """A collective was left because a machine of the job is gone (``str``: who said so, and why)."""


def lost(reason: str) -> None:
    """Say that a machine is gone: every ``wait`` of this process gives up with ``PeerLost(reason)``."""
    if not LOST.is_set():
        _reason.append(reason)
        LOST.set()


def reset() -> None:
    """A new round: nothing is lost in it yet."""
    _reason.clear()
    LOST.clear()


def wait(work: Any, poll_s: float = POLL_S) -> Any:
    """Wait for an ``async_op=True`` collective's ``work``: its result, or its own error (a peer that was killed), or
    ``PeerLost`` as soon as ``LOST`` is set (a peer that froze)."""
    done = threading.Event()
    future = work.get_future()
    future.add_done_callback(lambda _: done.set())
    while not done.wait(poll_s):
        if LOST.is_set():
            GRAVEYARD.append(work)  # dropped, it would block in its destructor until the group's timeout
            raise PeerLost(_reason[0] if _reason else "a machine of this job is gone")
    return future.wait()


def watch_store(store: Any, stop: threading.Event, poll_s: float = POLL_S) -> threading.Thread:
    """A daemon thread that sets ``LOST`` when ``LOST_KEY`` appears in ``store`` (until ``stop`` is set)."""

    def run() -> None:
        while not stop.is_set() and not LOST.is_set():
            try:
                if store.check([LOST_KEY]):
                    lost(store.get(LOST_KEY).decode())
                    return
            except RuntimeError:  # the store's host is gone: nothing more to learn from it
                return
            stop.wait(poll_s)

    thread = threading.Thread(target=run, name="heal-watch", daemon=True)
    thread.start()
    return thread
