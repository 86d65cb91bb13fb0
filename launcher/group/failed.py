"""The one place that turns torch's errors into ours: ``typed_errors``, around the trainer's loop, raises a torch
error of a failed collective again as ``PeerLost`` (a machine of the job is gone: the abort signal tripped),
``CollectiveTimedOut`` or ``CollectiveFailed`` (torch's message says so: ``launcher.base.errors.TORCH_SAYS``),
``from`` torch's, which stays in the traceback. Anything else, a user's ``RuntimeError`` (a shape mismatch, an
injected fault) among it, passes unchanged, its traceback as it was.

Why here and once: gloo fails a collective with a plain ``RuntimeError`` whose text alone says a peer's connection
closed, and torch's wrapper of a failed future's callback hides even the type of the error our abort signal set
(``Got the following error when running the callback: PeerLost: ...``). Past this place the trainer, the healing
seam and the failure report ask about types only, so no ``except RuntimeError`` is needed anywhere else."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist

from launcher.base.errors import CALLBACK_ERROR, Kind, LauncherError, raised_by_torch, torch_said
from launcher.group.abort import Abort, PeerLost


class CollectiveFailed(LauncherError):
    """A collective failed because a peer did (torch's error, its ``__cause__``, said so): a consequence, not a
    root cause; in a job that heals, perhaps a machine lost (``Healing.lost`` asks the keeper)."""

    kind = Kind.peer


class CollectiveTimedOut(CollectiveFailed):
    """A collective gave up waiting (``comm.timeout_s``): a rank never reached it, or the network lost it
    (``stall.timed_out`` says which, with where and after how long)."""


def typed(exc: BaseException, abort: Optional[Abort] = None) -> Union[PeerLost, CollectiveFailed, None]:
    """Our error for ``exc``, torch's: ``PeerLost`` once ``abort`` has tripped (a machine is gone; torch's error is
    its consequence), else what torch's message says; None: not torch's error of a failed collective."""
    if not raised_by_torch(exc):
        return None
    if abort is not None and (lost := abort.lost_within(0.0)) is not None:
        return lost
    said = torch_said(exc)
    if said is None:
        return None
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first = line.partition(CALLBACK_ERROR)[2] or line  # the failed callback's own error, not torch's wrapper
    return (CollectiveTimedOut if said.timed_out else CollectiveFailed)(first)  # what torch saw: the fact


def waited(store: dist.Store, keys: list[str], timeout: timedelta) -> bool:
    """``store.wait`` as a question: True once every key is there; False where the store gave up waiting within
    ``timeout`` or could not be asked (torch's ``DistError``; a ``FileStore``'s timeout, a plain ``RuntimeError``
    whose text ``TORCH_SAYS`` knows; an ``OSError``). Anything else is raised."""
    try:
        store.wait(keys, timeout)
    except (dist.DistError, OSError):
        return False
    except RuntimeError as exc:  # (not a DistError: a FileStore's "Wait timeout")
        if (said := torch_said(exc)) is None or not said.timed_out:
            raise
        return False
    return True


@contextlib.contextmanager
def typed_errors(abort: Optional[Abort] = None) -> Iterator[None]:
    """Raise a torch error of a failed collective leaving the block as ours (``typed``), ``from`` it; anything
    else as it is. ``abort``: the rank's abort signal in a job that heals in place."""
    try:
        yield
    except RuntimeError as exc:  # the one broad catch of torch's errors (DistError derives from RuntimeError)
        ours = typed(exc, abort)
        if ours is None:
            raise
        raise ours from exc
