"""A timeline of a few training steps in the Chrome trace format (open it in https://ui.perfetto.dev or
chrome://tracing): one process per rank, one track per activity, so overlap of communication with the
backward pass can be seen, not just inferred.

Tracks: ``step`` (forward, backward, optimizer, as the trainer marks them), ``buckets`` (each bucket's allreduce
from launch to completion) and, for node-first reduction, one track per phase (``reduce (node)``,
``allreduce (leaders)``, ``broadcast (node)``). Times come from ``time.perf_counter_ns`` (CLOCK_MONOTONIC): ranks
on one host share that clock; across hosts each host's tracks are shifted by that host's start (``write_trace``).

Recording is off unless a ``Tracer`` is active (``with Tracer(rank).activate(): ...``); when off, the cost is
one global read per bucket.
"""

from __future__ import annotations

import contextlib
import json
import math
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
    """Merge every rank's ``trace_events()`` into one Chrome trace file. CLOCK_MONOTONIC counts from each host's
    boot: each host's events are taken relative to that host's earliest (the traced steps begin together on every
    rank, after a collective), so ranks on one host keep their exact offsets and hosts line up at the start."""
    t0: dict[str, float] = {}
    for rank_events in per_rank:
        host = _host(rank_events)
        t0[host] = min([t0.get(host, math.inf), *(e["ts"] for e in rank_events if "ts" in e)])
    for rank_events in per_rank:
        start = t0[_host(rank_events)]
        for e in rank_events:
            if "ts" in e:
                e["ts"] = round(e["ts"] - start, 3)
    path = Path(path)
    events = [e for rank_events in per_rank for e in rank_events]
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def _host(rank_events: list[dict[str, Any]]) -> str:
    """The host in the rank's process label ("rank 3 (node2)"), "" when none."""
    for e in rank_events:
        if e.get("name") == "process_name":
            return str(e["args"]["name"]).partition(" (")[2].rstrip(")")
    return ""
