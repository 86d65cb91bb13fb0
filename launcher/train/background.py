"""Checkpoints written in the background (``train.checkpoint_async=true``): the training loop waits only for a copy
of the state (staged into buffers kept from one save to the next: torch's ``DefaultStager``, plain host memory on a
CPU, no pinned or shared memory), then goes on while a thread writes it. One write at a time: the next save, a stop
signal and the end of the run wait for the one in flight (and say so when they do). A write never leaves anything
that looks like a checkpoint before it is whole (a file's temporary name, a sharded directory's ``.tmp``: the caller's
``write``), so a crash mid-write leaves the previous checkpoint the newest. A write that failed is raised, as the
synchronous save would have raised it, at the next save or wait."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

log = logging.getLogger(__name__)


class Background:
    """At most one checkpoint being written."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(False, False, False, False))  # synchronous copy, buffers kept
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Optional[tuple[int, Future]] = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` (its tensors copied into this object's kept buffers; the previous write must be done:
        ``wait`` first)."""
        return self.stager.stage(state)  # type: ignore[return-value]  # (synchronous: a dict, not a Future)

    def start(self, step: int, write: Callable[[], None]) -> None:
        """``write`` (of step ``step``'s staged state) on the writer thread."""
        self._pending = (step, self._pool.submit(write))

    def wait(self, why: str = "") -> None:
        """The write in flight, finished (its error raised here); ``why``: who waits, said when it must."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        if why and not future.done():
            log.info("%s waits for the checkpoint of step %d being written", why, step)
        future.result()

    def close(self) -> None:
        """After ``wait``: the writer thread ends (a write still running finishes first)."""
        self._pool.shutdown(wait=True)
