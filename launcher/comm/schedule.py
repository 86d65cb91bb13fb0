"""When the forward overlap launches each chunk: a model of the link every rank agrees on.

Every rank must launch the same collectives in the same order, so the reducer decides only at points every rank
reaches in the same sequence (its bucket events, the first layer's row blocks: tail.py) and from numbers every
rank holds: this schedule. It comes from the warm-up passes (every bucket sent whole at its event): when each
dense bucket event came and when the last allreduce ended, the slowest rank's (one allreduce), of the passes the
one whose allreduces ended first. It models the link as one queue drained at the link's rate: at each point the
reducer sends the pooled chunks, most urgent first, that the modelled link would finish by the next point plus
``SLACK_CHUNKS`` chunks, so the link never idles and a more urgent chunk finds a short queue before it.
``WarmUp`` takes those measurements and holds the schedule once agreed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from launcher.comm.buckets import Bucket
from launcher.comm.sizes import nbytes

SLACK_CHUNKS = 1  # chunks the modelled queue may hold past the next launch point
WARMUP_STEPS = 3  # synchronised passes run as in the backward mode before the forward overlap; all but the first
#                  (new connections, cold caches: measured 4x slower) are timed for the model of the link


@dataclass(frozen=True)
class Schedule:
    rate: float  # bytes per second the link carries while backward computes
    slack: float  # seconds the modelled queue may run past the next launch point
    events: list[float]  # seconds from the first dense bucket event to each
    tail: list[float] | None  # seconds to the moment each chunk of the last bucket is ready (tail.py)

    @classmethod
    def agree(
        cls, timed: list[list[float]], sizes: list[int], chunk: int, tail_shares: list[float] | None, world_size: int
    ) -> Schedule:
        """``timed``: per warm-up pass, seconds from the first event to each later one, then to the end of the last
        allreduce; ``sizes``: bytes of each dense bucket; ``chunk``: the largest chunk's bytes; ``tail_shares``: per
        chunk of the last bucket, the share of the first layer's rows computed when it can go (None: no tail).
        The rate: after some event the link carried every byte from that event on by the end; the largest such
        bytes / time (a link idle while backward computes does not lower it)."""
        times = torch.tensor(timed, dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        *later, end = times[int(times[:, -1].argmin())].tolist()
        events = [0.0, *later]
        rate = max(sum(sizes[k:]) / max(end - t, 1e-6) for k, t in enumerate(events))
        tail = None
        if tail_shares is not None and len(events) >= 2:
            # the tail's chunks leave while the last bucket's event is computed: their times, interpolated between
            # the two last events by the share of the first layer's rows each one needs
            before, last = events[-2], events[-1]
            tail = [before + share * (last - before) for share in tail_shares]
        return cls(rate, SLACK_CHUNKS * chunk / rate, events, tail)

    def at_event(self, event: int, tail_expected: bool) -> tuple[float, float]:
        """(now, next launch point) at dense bucket event ``event``; the last event sends everything. Before the
        last bucket's event, when the tail is expected to send early, the next point is its first chunk: the first
        layer's chunks then overtake the second layer's."""
        if event + 1 >= len(self.events):
            return 0.0, math.inf
        if self.tail and tail_expected and event == len(self.events) - 2:
            return self.events[event], self.tail[0]
        return self.events[event], self.events[event + 1]

    def after_tail_chunk(self, chunk: int) -> tuple[float, float]:
        """(now, next launch point) once the tail has sent the last bucket's chunk ``chunk``."""
        assert self.tail is not None
        following = self.tail[chunk + 1] if chunk + 1 < len(self.tail) else self.events[-1]
        return self.tail[chunk], following

    def carried(self, free: float, now: float, size: int) -> float:
        """When the modelled link, free from ``free`` on, has carried ``size`` more bytes launched at ``now``."""
        return max(free, now) + size / self.rate

    def fits(self, free: float, now: float, until: float, size: int) -> bool:
        return until == math.inf or self.carried(free, now, size) <= until + self.slack


class WarmUp:
    """The forward overlap's first ``WARMUP_STEPS`` synchronised passes (every bucket sent whole at its event,
    waited for before backward returns): each timed pass's dense bucket events and the end of its allreduces; after
    the last one, the ``schedule`` every rank agreed."""

    def __init__(self) -> None:
        self.synced = 0  # synchronised backward passes so far
        self.events: list[float] = []  # this pass: each dense bucket event's time (the schedule's index)
        self.timed: list[list[float]] = []  # per timed pass, seconds from the first event to each, then the end
        self.schedule: Schedule | None = None

    @property
    def done(self) -> bool:
        return self.synced >= WARMUP_STEPS

    def begin_pass(self) -> None:
        self.events = []

    def event(self) -> int:
        """A dense bucket event now: its index in this pass."""
        self.events.append(time.perf_counter())
        return len(self.events) - 1

    def end_pass(self, dense: Sequence[Bucket], tail_shares: list[float] | None, world_size: int) -> None:
        """A warm-up pass's allreduces have all ended (``synced`` already counts it): the last one agrees the
        schedule (one allreduce)."""
        if not self.events or not 1 < self.synced <= WARMUP_STEPS:
            return
        self.events.append(time.perf_counter())
        self.timed.append([t - self.events[0] for t in self.events[1:]])
        if self.synced == WARMUP_STEPS:
            sizes = [sum(nbytes(c) for c in b.chunks) for b in dense]
            largest = max(nbytes(c) for b in dense for c in b.chunks)
            self.schedule = Schedule.agree(self.timed, sizes, largest, tail_shares, world_size)
            self.timed = []

    def drop_tail(self) -> None:
        """The tail no longer sends early: the schedule without its launch points."""
        if self.schedule is not None:
            self.schedule = dataclasses.replace(self.schedule, tail=None)
