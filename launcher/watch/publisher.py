"""Every rank's side of the watch: each beat, what its flight recorder says (per process group the newest entered
and completed collective, the one it waits in) goes into ``RUN_DIR/watch/<launch>/attempt-<n>/rank-<k>.json``;
every few seconds, into ``rank-<k>.arrivals.json``, when it entered each recent collective (stragglers); and when
the reporter asks (``request.json``), its whole flight recorder and the live stack of every thread go into the
hang's folder.

Files, not the rendezvous store: rank 0 hosts the store, and a stopped rank 0 would silence every rank; the run dir
is on a shared file system in every multi-node mode (the failure records rely on it too)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

from launcher.base.env import DistEnv
from launcher.base.files import write_atomic
from launcher.base.liveness import ARRIVALS_EVERY_S, STEP_NOTE_S
from launcher.base.run_dir import RunDir, arrivals_file, flight_record_file, progress_file, request_file, stack_file
from launcher.report.tracebacks import WRAPPER_FRAMES
from launcher.watch import recorder

ARRIVALS_MAX = 512  # the newest entries handed out per read


OWN_THREADS = (
    "launcher-watch",
    "stop-watch",
    "heal-watch",
)  # the launcher's own threads in a rank: not where it is stuck
NOT_WHERE = (*WRAPPER_FRAMES, "threading.py")  # frames that only carry a thread to its work


def stacks(skip: int | None = None) -> str:
    """Every thread's Python stack as a traceback prints it, innermost last, the main thread first; without the
    launcher's own threads (``skip``: the calling thread) and the frames that only carry a thread to its work."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    parts = []
    for ident in sorted(frames, key=lambda i: (names.get(i) != "MainThread", str(names.get(i, i)))):
        if ident == skip or names.get(ident) in OWN_THREADS:
            continue
        kept = [e for e in traceback.format_stack(frames[ident]) if not any(p in e.split('"')[1] for p in NOT_WHERE)]
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n{''.join(kept).rstrip()}")
    return "\n\n".join(parts)


class Publisher:
    def __init__(self, run_dir: RunDir, env: DistEnv, round_: int = 0, left: frozenset[str] = frozenset()) -> None:
        self.env = env
        self.dir = run_dir.watch(env.launch_id, env.attempt, round_)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = progress_file(self.dir, env.rank)
        self.recorder = recorder.Recorder(ignored=set(left))  # a healed round: not the groups it left
        self.last: dict[str, tuple[int, int]] = {}
        self.progress_ns = time.time_ns()
        self.waiting: dict[tuple[str, int], dict[str, Any]] = {}  # (group, seq) -> its entry, once looked up
        self.arrivals_at = 0.0
        self.batch = 0
        self.steps: deque[list[int]] = deque(maxlen=64)
        self.answered = 0
        self.request_seen = 0.0
        self.ended = ""
        self.busy_s = 0.0  # time the watch thread spent working (its cost, for bench/watch.py)

    def note_step(self, step: int) -> None:
        """Kept at most every STEP_NOTE_S: the notes span the straggler window."""
        now = time.time_ns()
        if not self.steps or now - self.steps[-1][1] >= STEP_NOTE_S * 1e9:
            self.steps.append([step, now])

    def beat(self, with_arrivals: bool) -> dict[str, Any]:
        """Read the recorder, write this rank's progress; returns it."""
        status = self.recorder.status()
        if any(status.get(g, (0, -1))[1] != self.last.get(g, (0, -1))[1] for g in status):
            self.progress_ns = time.time_ns()
        previous, self.last = self.last, status
        self.waiting = {k: v for k, v in self.waiting.items() if k[1] > status.get(k[0], (0, k[1]))[1]}  # still open
        groups = {}
        names = recorder.members()
        everyone = list(range(self.env.world_size))  # written as None: 1,024 ranks made every file 7 KB
        for group, (enqueued, completed) in status.items():
            waiting = None
            if enqueued > completed:
                key = (group, completed + 1)
                if key not in self.waiting and previous.get(group) == (enqueued, completed):  # a beat or more
                    self.waiting[key] = self.recorder.waiting(group, completed + 1)
                waiting = self.waiting.get(key)
            groups[group] = {
                "members": None if (members := names.get(group)) == everyone else members,  # None: every rank
                "desc": self.recorder.descs.get(group, ""),
                "enqueued": enqueued,
                "completed": completed,
                "waiting": waiting,
            }
        if with_arrivals and time.monotonic() - self.arrivals_at >= ARRIVALS_EVERY_S:
            self.arrivals_at, self.batch = time.monotonic(), self.batch + 1
            batch = {"batch": self.batch, "arrivals": self.recorder.arrivals(ARRIVALS_MAX)}
            write_atomic(arrivals_file(self.dir, self.env.rank), json.dumps(batch), sync=False)
        progress = {
            "rank": self.env.rank,
            "host": self.env.hostname or socket.gethostname(),
            "node": self.env.node_rank,
            "pid": os.getpid(),
            "beat_ns": time.time_ns(),
            "progress_ns": self.progress_ns,
            "ended": self.ended,
            "steps": list(self.steps),
            "groups": groups,
            "batch": self.batch,  # the newest rank-K.arrivals.json
            "answered": self.answered,
            "busy_s": round(self.busy_s, 4),
        }
        write_atomic(self.path, json.dumps(progress), sync=False)
        return progress

    def answer(self, skip_thread: int | None) -> None:
        """Answer the reporter's newest request: the flight recorder and the stacks into the hang's folder."""
        request = request_file(self.dir)
        try:
            changed = request.stat().st_mtime
        except FileNotFoundError:
            return
        if changed == self.request_seen:
            return
        self.request_seen = changed
        try:
            asked = json.loads(request.read_text())
        except (OSError, ValueError):
            return
        if asked["id"] <= self.answered:
            return
        folder = Path(asked["dir"])
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(flight_record_file(folder, self.env.rank), recorder.dump_json())
        write_atomic(stack_file(folder, self.env.rank), stacks(skip_thread) + "\n")
        self.answered = asked["id"]
