"""The progress watch at scale, for bench/scale.py: many simulated ranks on a few processes, rank 0's real watch.

Every simulated rank is the real ``launcher.watch.publisher.Publisher`` (its progress file once a second, its
arrivals every few seconds, its answer to a hang's request) whose flight recorder is a ``FakeRecorder``: a
deterministic timeline from the wall clock (step k's collective entered at t0 + k * STEP_S plus a per-rank jitter,
completed at t0 + k * STEP_S + COLL_S), so the processes need nothing from each other but their arguments. From
step ``stall_at`` on the culprit never enters the collective; every other rank waits in it. Rank 0 runs the real
``launcher.watch.Watch`` thread (publisher and reporter) over the same run dir, and prints one JSON line: the CPU
its watch thread used over the clean window (from /proc: user + system time of that thread) and when the hang was
named (the watch's first warning naming the culprit), both measured from the same clock as the timeline.

    python bench/scale_watch.py host RUN T0 RANKS NODES FIRST LAST STALL_AT CULPRIT
    python bench/scale_watch.py zero RUN T0 RANKS NODES WARN_S CLEAN_S STALL_AT CULPRIT
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from launcher.base.env import DistEnv
from launcher.base.run_dir import RunDir
from launcher.watch import Watch, recorder
from launcher.watch.publisher import Publisher

STEP_S = 0.5  # one collective a step
COLL_S = 0.3  # every rank has entered it by then (the jitter is below): it completes
WHAT = "gloo:all_reduce [[262144]] Float"


class FakeRecorder:
    """The flight recorder's view a Publisher reads (``recorder.Recorder``'s methods), from a timeline."""

    def __init__(self, rank: int, t0: float, stall_at: int, culprit: int) -> None:
        self.rank, self.t0, self.stall_at, self.culprit = rank, t0, stall_at, culprit
        self.descs = {"0": "default_pg"}
        self.handed = -1  # the newest seq handed out by arrivals

    def entered_at(self, seq: int) -> float:
        return self.t0 + seq * STEP_S + (zlib.crc32(f"{self.rank}/{seq}".encode()) % 1000) / 1000 * 0.2

    def _seqs(self) -> tuple[int, int]:
        """(entered, completed) now."""
        now = time.time()
        k = int((now - self.t0) // STEP_S)
        entered = k if now >= self.entered_at(k) else k - 1
        completed = k if now >= self.t0 + k * STEP_S + COLL_S else k - 1
        if k >= self.stall_at:  # the culprit never enters stall_at; the others wait in it
            entered = self.stall_at - 1 if self.rank == self.culprit else min(entered, self.stall_at)
            completed = min(completed, self.stall_at - 1)
        return entered, completed

    def status(self) -> dict[str, tuple[int, int]]:
        return {"0": self._seqs()}

    def waiting(self, group: str, seq: int) -> dict[str, Any]:
        return {"seq": seq, "what": WHAT, "since_ns": int(self.entered_at(seq) * 1e9), "prev": WHAT}

    def arrivals(self, limit: int) -> list[list[Any]]:
        entered, _ = self._seqs()
        fresh = range(max(self.handed + 1, entered - limit + 1), entered + 1)
        self.handed = max(self.handed, entered)
        return [["0", seq, int(self.entered_at(seq) * 1e9), WHAT] for seq in fresh if seq >= 0]


def _fake_torch_side(ranks: int) -> None:
    recorder.members = lambda: {"0": list(range(ranks))}
    recorder.dump_json = lambda: b"{}"


def _env(rank: int, ranks: int, nodes: int) -> DistEnv:
    per = max(1, ranks // nodes)
    return DistEnv(rank, rank % per, ranks, per, rank // per, nodes, hostname=f"sim-{rank // per}", launch_id="scale")


def host(run: str, t0: float, ranks: int, nodes: int, first: int, last: int, stall_at: int, culprit: int) -> None:
    """Ranks first..last-1: each beats once a second (spread over the second), answers requests, until killed."""
    _fake_torch_side(ranks)
    pubs = []
    for rank in range(first, last):
        pub = Publisher(RunDir(run), _env(rank, ranks, nodes))
        pub.recorder = FakeRecorder(rank, t0, stall_at, culprit)  # type: ignore[assignment]
        pubs.append(pub)
    while True:
        second = time.time()
        for i, pub in enumerate(pubs):
            time.sleep(max(0.0, second + i / len(pubs) - time.time()))  # (a pace: one beat a second each)
            pub.beat(with_arrivals=True)
            pub.answer(None)


def zero(
    run: str, t0: float, ranks: int, nodes: int, warn_s: float, clean_s: float, stall_at: int, culprit: int
) -> None:
    """Rank 0's real watch; prints {"cpu": its share of a core in the clean window, "named_s": from the stall}."""
    _fake_torch_side(ranks)
    said: list[tuple[float, str]] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append((time.time(), record.getMessage()))  # type: ignore[method-assign]
    logging.getLogger("launcher.watch").addHandler(handler)
    watch = Watch(RunDir(run), _env(0, ranks, nodes), warn_s, None)
    watch.publisher.recorder = FakeRecorder(0, t0, stall_at, culprit)  # type: ignore[assignment]
    time.sleep(max(0.0, t0 - time.time()))
    watch.start()
    tick = os.sysconf("SC_CLK_TCK")

    def cpu_s() -> float:
        fields = Path(f"/proc/self/task/{watch.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    time.sleep(2.0)  # (the clean window starts after the first beats)
    start_wall, start_cpu = time.time(), cpu_s()
    time.sleep(max(0.0, t0 + clean_s - time.time()))
    cpu = (cpu_s() - start_cpu) / (time.time() - start_wall)
    stalled = t0 + (stall_at - 1) * STEP_S + COLL_S  # the last completion before the freeze
    named = None
    while named is None and time.time() < stalled + warn_s + 60:
        named = next((t for t, m in said if m.startswith(f"hang: rank {culprit} ")), None)
        time.sleep(0.1)  # (polls its own list)
    watch.end("returned")
    others = [m.splitlines()[0] for _, m in said if not m.startswith(f"hang: rank {culprit} ")][:3]
    print(json.dumps({"cpu": cpu, "named_s": None if named is None else named - stalled, "other": others}))


if __name__ == "__main__":
    role, run, t0, *numbers = sys.argv[1:]
    if role == "host":
        host(run, float(t0), *(int(n) for n in numbers))
    else:
        ranks, nodes, warn_s, clean_s, stall_at, culprit = numbers
        zero(run, float(t0), int(ranks), int(nodes), float(warn_s), float(clean_s), int(stall_at), int(culprit))
