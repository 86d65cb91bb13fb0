"""A timeline of a few training steps in the Chrome trace format (open it in https://ui.perfetto.dev or
chrome://tracing): one process per rank, one track per activity, so overlap of communication with the
backward pass can be seen, not just inferred.

Tracks: ``step`` (forward, backward, optimizer, as the trainer marks them), ``buckets`` (each bucket's allreduce
from launch to completion) and, for node-first reduction, one track per phase (``reduce (node)``,
``allreduce (leaders)``, ``broadcast (node)``). Times come from ``time.perf_counter_ns`` (CLOCK_MONOTONIC): ranks
on one host share that clock; across hosts each rank's track is shifted by its own start.

Recording is off unless a ``Tracer`` is active (``with Tracer(rank).activate(): ...``); when off, the cost is
one global read per bucket.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from torch.futures import Future

_ACTIVE: Optional[Tracer] = None


def active() -> Optional[Tracer]:
    return _ACTIVE


class Tracer:
    def __init__(self, rank: int, host: str = "") -> None:
        self.rank, self.host = rank, host
        self.events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()  # comm threads and gloo callbacks record too

    @contextlib.contextmanager
    def activate(self) -> Iterator[Tracer]:
        global _ACTIVE
        _ACTIVE = self
        try:
            yield self
        finally:
            _ACTIVE = None

    def record(self, name: str, track: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """One complete event ("X") on ``track``."""
        with self._lock:
            tid = self._tracks.setdefault(track, len(self._tracks))
            self.events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": self.rank,
                    "tid": tid,
                    "ts": start_ns / 1e3,
                    "dur": (end_ns - start_ns) / 1e3,
                    **({"args": args} if args else {}),
                }
            )

    @contextlib.contextmanager
    def span(self, name: str, track: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            self.record(name, track, start, time.perf_counter_ns(), **args)

    def trace_events(self) -> list[dict[str, Any]]:
        """Events plus the metadata that names this rank's process and tracks."""
        label = f"rank {self.rank}" + (f" ({self.host})" if self.host else "")
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": label}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "args": {"sort_index": self.rank}},
        ]
        for track, tid in self._tracks.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": track}})
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid, "args": {"sort_index": tid}}
            )
        return meta + self.events


def span(name: str, track: str, **args: Any) -> contextlib.AbstractContextManager:
    """``with trace.span(...)``: recorded when a tracer is active, free otherwise."""
    tracer = _ACTIVE
    return tracer.span(name, track, **args) if tracer is not None else contextlib.nullcontext()


def until_done(future: Future, name: str, track: str, **args: Any) -> None:
    """Record ``name`` on ``track`` from now until ``future`` completes, when a tracer is active."""
    tracer = _ACTIVE
    if tracer is not None:
        start = time.perf_counter_ns()
        future.then(lambda _: tracer.record(name, track, start, time.perf_counter_ns(), **args))


def write_trace(path: str | Path, per_rank: list[list[dict[str, Any]]]) -> Path:
    """Merge every rank's ``trace_events()`` into one Chrome trace file, times relative to the earliest."""
    events = [e for rank_events in per_rank for e in rank_events]
    t0 = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - t0, 3)
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
