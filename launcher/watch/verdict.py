"""Which rank holds the job up? Pure functions over the ranks' published progress (no torch, no files), so every
case is tested without processes.

A rank's progress (what ``publisher.py`` writes each beat) is a dict: ``rank host pid node beat_ns progress_ns
ended step`` and ``groups``: per process group name ``members`` (global ranks), ``enqueued`` / ``completed`` (its
newest sequence numbers) and ``waiting`` (the collective it waits in: ``seq what prev since_ns``, or None).

- a **hang**: some rank waits in collective #S of a group while a member of that group has not entered #S; the
  ranks it waits for are followed (a rank they wait for may itself wait in another group: the node-first
  hierarchy's leader group) to the ones that wait for nothing: the culprits (busy outside collectives, ended,
  or silent: stopped or frozen);
- a **desync**: ranks of one group at the same #S in different collectives (another op, other sizes or dtypes:
  e.g. one rank skipped a collective); the culprit side is the minority, on a tie the side that left the op both
  sides ran at #S-1;
- a **straggler**: over a window of steps, a rank that is the last to enter nearly every step's collectives, late
  by at least a share of the step time (when each rank entered each collective: ``time_created_ns``; the hosts'
  clocks are taken to agree to well under a step, as NTP keeps them).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Progress = Mapping[str, Any]


@dataclass(frozen=True)
class Hang:
    kind: str  # "hang" | "desync" | "deadlock"
    culprits: tuple[int, ...]  # first in every report
    group: str  # the process group the anchor waits in
    seq: int
    what: str  # the collective waited in (signature), "" when not known yet
    waiting: tuple[int, ...]  # the ranks waiting in it
    stalled_s: float  # since any rank last completed a collective
    sides: tuple[tuple[str, tuple[int, ...]], ...] = ()  # desync: each collective and its ranks, culprits first
    notes: dict[int, str] = field(default_factory=dict)  # culprit -> where it is instead


def _waits(progress: Progress) -> tuple[str, int, dict[str, Any]] | None:
    """The collective a rank waits in (the oldest, when several groups wait): group, seq, its entry."""
    found = []
    for name, group in (progress.get("groups") or {}).items():
        if group["enqueued"] > group["completed"]:
            entry = group.get("waiting") or {}
            since = int(entry.get("since_ns") or progress.get("beat_ns") or 0)
            found.append((since, name, group["completed"] + 1, entry))
    if not found:
        return None
    _, name, seq, entry = min(found, key=lambda f: f[0])
    return name, seq, entry


def _completed(ranks: Mapping[int, Progress]) -> dict[str, int]:
    """Per group, the newest collective any member completed (one pass over the ranks)."""
    done: dict[str, int] = {}
    for p in ranks.values():
        for group, g in p.get("groups", {}).items():
            done[group] = max(done.get(group, -1), g.get("completed", -1))
    return done


def _past_done(
    wait: tuple[str, int, dict[str, Any]] | None, mine: Progress, completed: Mapping[str, int]
) -> tuple[str, int, dict[str, Any]] | None:
    """A collective that a member of its group completed had every member in it: where a rank's oldest open one is
    such (gloo records an async op's end only once it is waited on), the rank waits in the next one it enqueued
    (its description unknown here), or in none. ``completed``: ``_completed(ranks)``."""
    if wait is None:
        return None
    group, seq, entry = wait
    done = completed.get(group, -1)
    if seq > done:
        return wait
    enqueued = mine["groups"][group]["enqueued"]
    if enqueued <= done:
        return None
    return group, done + 1, {**entry, "seq": done + 1, "what": ""}


def _blockers(rank: int, group: str, seq: int, ranks: Mapping[int, Progress], world: int) -> list[int]:
    """The members of ``group`` that have not entered its collective ``seq``."""
    members = ranks[rank]["groups"][group].get("members") or list(range(world))
    late = []
    for member in members:
        theirs = (ranks.get(member) or {}).get("groups", {}).get(group)
        if member != rank and (theirs is None or theirs["enqueued"] < seq):
            late.append(member)
    return late


def _note(rank: int, ranks: Mapping[int, Progress], now_ns: int, stale_s: float, group: str) -> str:
    progress = ranks.get(rank)
    if progress is None:
        return "has reported no progress (its watch never started: it may not have reached its script or trainer)"
    mine = progress.get("groups", {}).get(group)
    last = f"#{mine['completed']}" if mine and mine["completed"] >= 0 else "none"
    if progress.get("ended"):
        return f"ended ({progress['ended']}); its last completed collective of this group: {last}"
    silent_s = (now_ns - progress["beat_ns"]) / 1e9
    if silent_s > stale_s:
        return f"has been silent for {silent_s:.0f} s (stopped, or frozen); when last heard it had completed {last}"
    return f"is busy outside collectives; its last completed collective of this group: {last}"


def find_hang(ranks: Mapping[int, Progress], world: int, now_ns: int, stale_s: float) -> Hang | None:
    """The hang holding the job up, when a rank waits in a collective (None when none waits)."""
    completed = _completed(ranks)  # once: per waiting rank it made the verdict O(waiting x ranks)
    waits = {
        r: w for r, p in ranks.items() if not p.get("ended") and (w := _past_done(_waits(p), p, completed)) is not None
    }
    if not waits:
        return None
    anchor = min(waits, key=lambda r: (waits[r][2].get("since_ns", now_ns), r))
    group, seq, entry = waits[anchor]
    newest = max((p.get("progress_ns", 0) for p in ranks.values()), default=0)
    stalled_s = max(0.0, (now_ns - newest) / 1e9) if newest else 0.0
    there = sorted(r for r, w in waits.items() if w[0] == group and w[1] == seq)
    sides: dict[str, list[int]] = {}
    for r in there:
        sides.setdefault(waits[r][2].get("what", ""), []).append(r)
    if len(sides) > 1 and "" not in sides:
        ordered = _culprit_side_first(sides, {r: waits[r][2].get("prev", "") for r in there})
        culprits = tuple(ordered[0][1])
        return Hang("desync", culprits, group, seq, entry.get("what", ""), tuple(there), stalled_s, ordered)
    roots, seen, todo = [], {anchor}, [anchor]
    while todo:
        rank = todo.pop()
        g, s, _ = waits[rank]
        for blocker in _blockers(rank, g, s, ranks, world):
            if blocker in seen:
                continue
            seen.add(blocker)
            if blocker in waits and (now_ns - ranks[blocker]["beat_ns"]) / 1e9 <= stale_s:
                todo.append(blocker)
            else:
                roots.append(blocker)
    kind = "hang" if roots else "deadlock"
    culprits = tuple(sorted(roots)) if roots else tuple(sorted(seen - {anchor}))
    notes = {r: _note(r, ranks, now_ns, stale_s, group) for r in roots}
    return Hang(kind, culprits, group, seq, entry.get("what", ""), tuple(there), stalled_s, notes=notes)


def _culprit_side_first(sides: dict[str, list[int]], prev: dict[int, str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The minority first; on a tie, the side that left the collective every rank ran at #S-1."""
    common = {p for p in prev.values()}
    routine = next(iter(common)) if len(common) == 1 else None

    def key(item: tuple[str, list[int]]) -> tuple[int, int, int]:
        what, members = item
        return (len(members), 0 if what != routine else 1, -min(members))

    return tuple((what, tuple(members)) for what, members in sorted(sides.items(), key=key))


# ------------------------------------------------------------------------------------------------ stragglers
@dataclass(frozen=True)
class Straggler:
    rank: int
    late_s: float  # how much later than the others it enters a step's collectives (median over the window)
    step_s: float  # the step time over the window
    since_ns: int  # the first step of the window it was last in

    @property
    def share(self) -> float:
        return self.late_s / self.step_s if self.step_s > 0 else 0.0


MIN_STEPS = 5  # steps in a window before anyone is named
CONSISTENT = 0.75  # the share of the window's steps a straggler must be the last in


def _behind(times: torch.Tensor) -> torch.Tensor:
    """``times``: [ranks, collectives] (ns). Each rank's lateness in each collective against the others' median
    (itself left out), doubled so that it stays an exact integer: O(ranks log ranks) per collective, in C."""
    n = times.shape[0]
    ordered, order = times.sort(dim=0, stable=True)
    place = torch.empty_like(order)
    place.scatter_(0, order, torch.arange(n).unsqueeze(1).expand_as(order))  # each rank's place in the order

    def at(k: int) -> torch.Tensor:  # the k-th of the others: the k-th, or the next one from the rank's place on
        return torch.where(place > k, ordered[k], ordered[min(k + 1, n - 1)])

    others = n - 1
    median2 = 2 * at(others // 2) if others % 2 else at(others // 2 - 1) + at(others // 2)
    return 2 * times - median2


def _steps(seqs: list[int], signature: Mapping[int, str]) -> list[list[int]]:
    """The collectives of each step: a step starts at each occurrence of the most frequent collective (the first
    seen on a tie: a training step's first bucket, a script's per-step all_reduce); occasional others (an
    evaluation, a log window) fall inside a step."""
    counts = Counter(signature[s] for s in seqs)
    most = max(counts.values())
    start = next(signature[s] for s in seqs if counts[signature[s]] == most)
    starts = [i for i, s in enumerate(seqs) if signature[s] == start]
    return [seqs[a:b] for a, b in zip(starts, starts[1:])]


def _onset(rank: int, lagging: list[bool], blocks: list[list[int]], arrivals: Mapping[int, Any]) -> int:
    """When the rank's lag began: the earliest step from which on it lagged in 90 % of the steps."""
    onset, count = len(lagging) - 1, 0
    for i in range(len(lagging) - 1, -1, -1):
        count += lagging[i]
        if count >= 0.9 * (len(lagging) - i):
            onset = i
    return int(arrivals[rank][blocks[onset][0]][0])


def find_stragglers(
    arrivals: Mapping[int, Mapping[int, tuple[int, str]]], window_s: float, min_share: float, min_late_s: float = 0.0
) -> list[Straggler]:
    """``arrivals``: rank -> {seq: (time_created_ns, signature)} in one group every rank belongs to. The ranks
    last to enter nearly every step of the newest ``window_s``, by ``min_share`` of the step time or more, and by
    ``min_late_s`` at least (a few ms on a short step is a loaded machine's noise, nothing to act on)."""
    ranks = sorted(arrivals)
    if len(ranks) < 2:
        return []
    seqs = sorted(set.intersection(*(set(arrivals[r]) for r in ranks)))
    if not seqs:
        return []
    # [ranks, collectives], relative to the earliest (exact in float64), and each collective's median arrival
    times = torch.tensor([[arrivals[r][seq][0] for seq in seqs] for r in ranks], dtype=torch.int64)
    times -= times.min()
    ordered = times.sort(dim=0).values
    medians = ((ordered[(len(ranks) - 1) // 2] + ordered[len(ranks) // 2]).double() / 2).tolist()
    keep = [i for i, m in enumerate(medians) if medians[-1] - m <= window_s * 1e9]
    seqs, times = [seqs[i] for i in keep], times[:, keep]
    middle = {seq: medians[i] for seq, i in zip(seqs, keep)}
    blocks = _steps(seqs, {s: arrivals[ranks[0]][s][1] for s in seqs})
    if len(blocks) < MIN_STEPS:
        return []
    step_s = statistics.median((middle[b[0]] - middle[a[0]]) / 1e9 for a, b in zip(blocks, blocks[1:]))
    column = {seq: i for i, seq in enumerate(seqs)}
    behind2 = _behind(times)
    late2 = torch.stack([behind2[:, [column[s] for s in block]].amax(dim=1) for block in blocks])  # [blocks, ranks]
    tops = [ranks[i] for i in late2.argmax(dim=1).tolist()]  # each step's latest (the first of a tie)
    found = []
    bar = max(min_share * step_s, min_late_s)
    for i, r in enumerate(ranks):
        if tops.count(r) < CONSISTENT * len(blocks) or step_s <= 0:
            continue
        late = (late2[:, i].double() / 2e9).tolist()
        if statistics.median(late) >= bar:
            lagging = [top == r and lag >= bar for top, lag in zip(tops, late)]
            found.append(Straggler(r, statistics.median(late), step_s, _onset(r, lagging, blocks, arrivals)))
    return found
