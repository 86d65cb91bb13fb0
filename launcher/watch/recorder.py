"""Reading torch's flight recorder from a thread, without touching the user's code (the only torch side of the watch).

torch (2.13, gloo and nccl alike) records every collective a process enqueues in a ring buffer of
``TORCH_FR_BUFFER_SIZE`` entries (read when a process group is created; ``comm.flight_recorder_entries`` sets it
before the rank's first group): its process group, its sequence number in that group, op, sizes, dtypes, and
``time_created_ns`` (the wall time this rank entered it). Two reads, of very different cost:

- ``status()``: per process group, the newest enqueued and completed sequence numbers (``pg_status``; ~50 us, read
  every beat);
- ``entries()``: the whole buffer without stack traces (~10 us per entry: 20 ms for 2000), read only for
  stragglers (every few seconds), for the collective a rank waits in, and for a hang report's dump.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import distributed_c10d as c10d

try:  # backend-neutral (gloo too) since torch 2.8 (pytorch#152563); older: the watch switches itself off
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json  # type: ignore[attr-defined]

    MISSING = ""
except ImportError:
    MISSING = (
        f"torch {torch.__version__} has no backend-neutral flight recorder (_dump_fr_trace_json: torch >= 2.8): "
        "the progress watch is off in this job (no hang, desync or straggler is named; comm.timeout_s still ends a "
        "stuck collective); HINT: a newer torch"
    )

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"


def enable(entries: int) -> None:
    """Size the recorder's buffer before this process creates its first process group (a user's own
    ``TORCH_FR_BUFFER_SIZE`` wins)."""
    os.environ.setdefault(BUFFER_ENV, str(entries))


def signature(entry: dict[str, Any]) -> str:
    """What a collective is, as ranks must agree on it: ``gloo:all_reduce [[1000]] Float``."""
    sizes = entry.get("input_sizes") or []
    dtypes = sorted(set(entry.get("input_dtypes") or []))
    shapes = json.dumps(sizes, separators=(",", ":"))
    return f"{entry.get('profiling_name', '?')} {shapes} {'/'.join(dtypes)}".strip()


@dataclass
class Recorder:
    """This rank's view of its flight recorder. ``names``: pg_id -> process group name (the name is the same on
    every rank: ``new_group`` is called in the same order everywhere), learnt from the entries."""

    names: dict[str, str] = field(default_factory=dict)
    descs: dict[str, str] = field(default_factory=dict)
    newest_record: int = -1  # the newest record id already handed out by ``arrivals``
    ignored: set[str] = field(default_factory=set)  # pg_ids of groups left behind (healing in place): not read

    def status(self) -> dict[str, tuple[int, int]]:
        """Per process group name: (newest enqueued, newest completed) sequence number (-1: none yet)."""
        raw = json.loads(_dump_fr_trace_json(includeCollectives=False)).get("pg_status", {})
        raw = {pg_id: s for pg_id, s in raw.items() if pg_id not in self.ignored}
        if any(pg_id not in self.names for pg_id in raw):
            self.entries()  # learn the names of groups seen for the first time
        return {
            self.names.get(pg_id, pg_id): (
                int(s.get("last_enqueued_collective", -1)),
                int(s.get("last_completed_collective", -1)),
            )
            for pg_id, s in raw.items()
        }

    def entries(self) -> list[dict[str, Any]]:
        """Every entry of the buffer (oldest first), without stack traces; learns the groups' names."""
        dump = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False))
        found = [e for e in dump.get("entries", []) if str(e.get("pg_id")) not in self.ignored]
        for entry in found:
            name, desc = (list(entry.get("process_group") or ["", ""]) + ["", ""])[:2]
            self.names[str(entry.get("pg_id"))] = str(name)
            self.descs[str(name)] = str(desc)
        return found

    def arrivals(self, limit: int) -> list[list[Any]]:
        """The entries recorded since the last call (at most the newest ``limit``): [group, seq, time_created_ns,
        signature] each: when this rank entered each collective, for the straggler score."""
        fresh = [e for e in self.entries() if int(e.get("record_id", -1)) > self.newest_record]
        if fresh:
            self.newest_record = max(int(e["record_id"]) for e in fresh)
        return [
            [str(e["process_group"][0]), int(e["collective_seq_id"]), int(e["time_created_ns"]), signature(e)]
            for e in fresh[-limit:]
            if not e.get("is_p2p")
        ]

    def waiting(self, group: str, seq: int) -> dict[str, Any]:
        """Collective ``seq`` of ``group`` (the one this rank waits in: op, sizes, since when) and, as ``prev``, the
        collective before it; one read of the buffer."""
        found: dict[int, dict[str, Any]] = {}
        for entry in self.entries():
            if str(entry["process_group"][0]) == group and int(entry["collective_seq_id"]) in (seq - 1, seq):
                found[int(entry["collective_seq_id"])] = entry
        mine = found.get(seq)
        return {
            "seq": seq,
            "what": signature(mine) if mine else "",
            "since_ns": int(mine["time_created_ns"]) if mine else time.time_ns(),
            "prev": signature(found[seq - 1]) if seq - 1 in found else "",
        }


def group_ids() -> set[str]:
    """The pg_ids the flight recorder knows now (a new round's watch leaves them out)."""
    return set(json.loads(_dump_fr_trace_json(includeCollectives=False)).get("pg_status", {}))


def dump_json() -> bytes:
    """The whole flight recorder as torch's own JSON (what ``fr_trace`` tools read), for a hang report."""
    return bytes(_dump_fr_trace_json(includeCollectives=True, onlyActive=False))


def members() -> dict[str, list[int]]:
    """Process group name -> its global ranks, for the groups this process belongs to."""
    found: dict[str, list[int]] = {}
    for pg, name in list(c10d._world.pg_names.items()):
        ranks = c10d._world.pg_group_ranks.get(pg)
        if ranks:
            found[str(name)] = sorted(int(r) for r in ranks)
    return found
