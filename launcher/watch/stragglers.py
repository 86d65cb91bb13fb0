"""Stragglers: rank 0's reporter takes in when each rank entered each collective (the ranks publish it every few
seconds), scores the newest window (``verdict.find_stragglers``) and names each change once: a rank starts
lagging (console, ``metrics.jsonl``) or keeps up again; ``events`` go into ``summary.json``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.base.files import read_bytes
from launcher.base.liveness import KEEP_ARRIVALS_S, STRAGGLER_MIN_LATE_S, STRAGGLER_WINDOW_S
from launcher.base.run_dir import RunDir, arrivals_file
from launcher.watch.verdict import find_stragglers

SHARE = 0.2  # a straggler is late by at least this share of the step time


class Stragglers:
    def __init__(self, run_dir: RunDir, say: Callable[[str], None], world: int) -> None:
        self.run, self.say, self.world = run_dir, say, world
        self.ranks: dict[int, dict[str, Any]] = {}
        self.batches: dict[int, int] = {}
        self.arrivals: dict[str, dict[int, dict[int, tuple[int, str]]]] = {}
        self.slow: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []

    def update(self, ranks: dict[int, dict[str, Any]], folder: Path, now_ns: int) -> None:
        """Take in the arrivals the ranks published since the last call; name changes."""
        self.ranks = ranks
        fresh = False
        for rank, p in self.ranks.items():
            if p.get("batch", 0) != self.batches.get(rank):
                try:
                    batch = json.loads(read_bytes(str(arrivals_file(folder, rank))))
                except (OSError, ValueError):
                    continue  # being replaced: read at the next beat
                self.batches[rank], fresh = batch["batch"], True
                for group, seq, t, sig in batch["arrivals"]:
                    self.arrivals.setdefault(group, {}).setdefault(rank, {})[seq] = (t, sig)
        if not fresh:
            return
        found: dict[int, Any] = {}
        for group, by_rank in self.arrivals.items():
            for rank in by_rank:
                by_rank[rank] = {s: v for s, v in by_rank[rank].items() if now_ns - v[0] < KEEP_ARRIVALS_S * 1e9}
            members = self._members(group)
            if not members or len(members) < 2 or any(m not in by_rank for m in members):
                continue
            for s in find_stragglers({m: by_rank[m] for m in members}, STRAGGLER_WINDOW_S, SHARE, STRAGGLER_MIN_LATE_S):
                if s.rank not in found or s.share > found[s.rank].share:
                    found[s.rank] = s
        self._changes(found)

    def _members(self, group: str) -> list[int] | None:
        for p in self.ranks.values():
            if group in p.get("groups", {}):
                return p["groups"][group].get("members") or list(range(self.world))  # None: every rank
        return None

    def _changes(self, found: dict[int, Any]) -> None:
        for rank, s in sorted(found.items()):
            if rank in self.slow:
                continue
            step = self._step_at(rank, s.since_ns)
            event = {
                "rank": rank,
                "host": self.ranks.get(rank, {}).get("host", "?"),
                "late_s": round(s.late_s, 4),
                "step_s": round(s.step_s, 4),
                "share": round(s.share, 3),
                "from_step": step,
                "until_step": None,
            }
            self.slow[rank] = event
            self.events.append(event)
            since = f"since step {step}" if step is not None else "since the window began"
            self.say(
                f"straggler: rank {rank} on {event['host']} enters each step's collectives {s.late_s:.3f} s after "
                f"the others ({100 * s.share:.0f} % of the {s.step_s:.3f} s step), {since}"
            )
            self._metric({"kind": "straggler", **event})
        for rank in [r for r in self.slow if r not in found]:
            event = self.slow.pop(rank)
            event["until_step"] = self._step_at(rank, time.time_ns())
            self.say(f"straggler: rank {rank} on {event['host']} keeps up again")
            self._metric({"kind": "straggler_recovered", **event})

    def _step_at(self, rank: int, t_ns: int) -> int | None:
        steps = [s for s, t in self.ranks.get(rank, {}).get("steps", []) if t <= t_ns]
        return steps[-1] + 1 if steps else None

    def _metric(self, record: dict[str, Any]) -> None:
        with open(self.run.metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
