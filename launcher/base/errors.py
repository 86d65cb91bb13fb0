"""The kinds of failure (``Kind``) and the base of every error the launcher raises on purpose (``LauncherError``,
which carries its kind by its type); torch's own messages, the only text ever read to tell a kind, in one table
(``TORCH_SAYS``). No torch here: the head's failure report (``launcher.report.failures``) runs without it.

Why types: the report ranks a job's failures by kind to name the root cause first, and the trainer must tell a
machine lost under a collective from an ordinary error. Read back from messages, the launcher's own errors were
told apart by words a reworded message silently broke; a user's error that happened to say "timed out after" was
taken for a peer's. Torch says what went wrong only in its messages (a gloo collective fails with a plain
``RuntimeError`` naming a peer's closed connection), so those are matched, here and nowhere else, and only on
errors torch raised (``raised_by_torch``): a user's own error is never read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Optional


class Kind(str, Enum):
    """How a rank's run ended. A failure record holds one of the first six, and the report looks for the root cause
    in that order (``RANKED``: then by time within a kind); the last two end the rank cleanly (``CLEAN``). Written
    to the records as the member's value: the same words as before the kinds were types."""

    error = "error"  # the rank's own exception: the user's code, or a launcher refusal (a forged value, a port taken)
    hang = "hang"  # named by the progress watch at comm.timeout_s: every other rank waited for this one
    died = "died"  # killed by a signal other than the stop signals, or ended without a record (OOM killer, os._exit)
    lost = "lost"  # healing in place gave up (HealStop): too few machines left, a round that never formed
    peer = "peer"  # a consequence of another rank failing or a machine lost: torch's messages, a rank that never
    # joined (JoinError), a collective that failed or timed out (CollectiveFailed, CollectiveTimedOut), PeerLost
    stopped = "stopped"  # ended by the launcher's stop signals (or Ctrl-C) after another rank failed
    left = "left"  # out of a job that goes on without it (LeftJob): exit 0, no failure record
    requeued = "requeued"  # a Slurm task left at its job's stop checkpoint (Requeued): exit 0, no record, no result

    def __str__(self) -> str:
        return self.value


RANKED = (Kind.error, Kind.hang, Kind.died, Kind.lost, Kind.peer, Kind.stopped)  # where a root cause is looked for
CLEAN = frozenset({Kind.left, Kind.requeued})  # the rank ends 0 and records nothing


class LauncherError(Exception):
    """An error the launcher raises on purpose: its kind is its class's (``kind``), never read from its message.
    A subclass that torch must see as a ``RuntimeError`` also derives from it, saying why."""

    kind: ClassVar[Kind] = Kind.error


def ends_cleanly(exc: BaseException) -> bool:
    """``exc`` is an outcome, not a failure: the rank ends 0 and writes no failure record (``CLEAN``)."""
    return isinstance(exc, LauncherError) and exc.kind in CLEAN


@dataclass(frozen=True)
class TorchSays:
    """One of torch's own messages (gloo, nccl, the c10d store; the type names of torch.distributed's errors are
    part of the text matched) and what it means."""

    said: re.Pattern[str]
    kind: Kind
    timed_out: bool = False  # a collective that gave up waiting (comm.timeout_s): the ranks then explain the stall


# The one table of torch's text; the first entry that matches tells (the timeouts first: narrower than the rest).
TORCH_SAYS = (
    # a collective that gave up waiting: gloo's "Timed out waiting 5000ms for recv operation to complete", nccl's
    # watchdog "Watchdog caught collective operation timeout"; a store's wait that gave up: a TCPStore's "wait
    # timeout after 200ms, keys: ...", a FileStore's plain "Wait timeout" (not any error that mentions a timeout)
    TorchSays(
        re.compile(r"Timed out waiting \d+ms|collective operation timeout|Watchdog caught|\bwait timeout\b", re.I),
        Kind.peer,
        timed_out=True,
    ),
    # a peer's connection gone: gloo's pairs ("Connection closed by peer", "Connection reset by peer", "Broken
    # pipe"), the c10d store's sockets ("Failed to recv", "recvValue", "Socket Timeout", torch's DistNetworkError
    # and DistStoreError), nccl's communicator aborted after a peer failed
    TorchSays(
        re.compile(
            r"closed by peer|reset by peer|Connection closed|Broken pipe|Connection refused|Timed out waiting|"
            r"NCCL communicator was aborted|remote process exited|failed to recv|recvValue|Socket Timeout|"
            r"DistNetworkError|DistStoreError",
            re.I,
        ),
        Kind.peer,
    ),
)

CALLBACK_ERROR = "Got the following error when running the callback: "  # torch's wrapper of a failed future's error


def raised_by_torch(exc: BaseException) -> bool:
    """``exc`` is of the types torch raises for a failed collective or store: exactly ``RuntimeError`` (gloo, torch's
    callback wrapper of a failed future) or one of torch's own (``torch.distributed.DistError`` and the like). A
    launcher error, or a user's own exception type, is not: its text is never read."""
    return type(exc) is RuntimeError or type(exc).__module__.split(".")[0] == "torch"


def torch_said(exc: BaseException) -> Optional[TorchSays]:
    """The entry of ``TORCH_SAYS`` that ``exc``'s own message matches, when torch raised it; None otherwise."""
    if not raised_by_torch(exc):
        return None
    text = f"{type(exc).__name__}: {exc}"
    return next((entry for entry in TORCH_SAYS if entry.said.search(text)), None)


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then the error it was raised from or while handling, and so on (each once)."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def kind_of(exc: BaseException) -> Kind:
    """The kind of a rank's error, by type first: the first launcher error along its chain gives its own kind, an
    interrupt is ``stopped``; then torch's own messages along it (``TORCH_SAYS``); else ``error``."""
    links = list(causes(exc))
    for link in links:
        if isinstance(link, LauncherError):
            return link.kind
        if isinstance(link, KeyboardInterrupt):
            return Kind.stopped
    return next((said.kind for link in links if (said := torch_said(link)) is not None), Kind.error)
