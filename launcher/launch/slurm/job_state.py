"""Whether a submitted Slurm job has ended, from the controller (``scontrol show job``), not from accounting.

submitit's ``done()`` on a job of several tasks reads ``sacct`` at its own rhythm (at most once per half the job's
age, whatever ``force_check`` says), and the accounting record lags the controller: a requeue's ``BeginTime`` hold
was seen seconds late or not at all, and once a requeued job was reported ``FAILED`` as it came back. The
controller's word (``JobState``, ``Reason``, ``Restarts``) is read at every turn instead; a job the controller has
already forgotten (``MinJobAge``) falls back to submitit's word.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from launcher.base.liveness import REQUEUE_GRACE_S, REVOKED_MARGIN_S
from launcher.base.run_dir import RunDir

# the states a job does not come back from by itself (a requeue brings it back: ``Restarts`` grows)
ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)
FIELDS = re.compile(r"\b(JobState|Reason|Restarts|SubmitTime)=(\S*)")
SLURM_TIME = "%Y-%m-%dT%H:%M:%S"  # scontrol's times, in the local time of the host that runs it


@dataclass(frozen=True)
class Live:
    state: str
    reason: str
    restarts: int
    submitted: str  # SubmitTime: a requeue sets it to the time of the requeue


def live(job_id: str) -> Live | None:
    """The controller's word on the job; None when it cannot say (the job forgotten, Slurm's tools unreachable)."""
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = dict(FIELDS.findall(shown.stdout))
    if shown.returncode or "JobState" not in fields or "SubmitTime" not in fields:
        return None
    return Live(fields["JobState"], fields.get("Reason", ""), int(fields.get("Restarts") or 0), fields["SubmitTime"])


def requeues_asked(run_dir: RunDir) -> int:
    """How many requeues rank 0 asked for (``task_entry.requeue`` writes the count before it asks)."""
    try:
        return int(json.loads(run_dir.requeues.read_text())["count"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


class JobWatch:
    """``ended()`` at each turn of a waiting loop: the job's final state once it ended, else None. A requeued job
    held by Slurm (``Reason=BeginTime``, ~10 s whatever the configuration) is released: the requeue came after the
    ranks' stop checkpoint, nothing needs that pause but the credential's second (``REVOKED_MARGIN_S``; a ``--begin``
    the user asked for holds only the first start, ``Restarts=0``)."""

    def __init__(self, submitted: Any, run_dir: RunDir) -> None:
        self.submitted, self.run_dir = submitted, run_dir
        self.job_id = str(submitted.job_id)
        self.ended_since: float | None = None
        self.released = 0  # the last start (Restarts) whose hold was released: once each

    def ended(self) -> str | None:
        now = live(self.job_id)
        if now is None:
            return str(self.submitted.state) if self.submitted.done(force_check=True) else None
        if now.state == "PENDING" and now.reason == "BeginTime" and now.restarts > self.released:
            release(self.job_id, now.submitted)
            self.released = now.restarts
        if now.state not in ENDED:
            self.ended_since = None
            return None
        if requeues_asked(self.run_dir) > now.restarts:  # rank 0 is asking for a requeue the controller has not seen
            if self.ended_since is None:
                self.ended_since = time.monotonic()
            if time.monotonic() - self.ended_since < REQUEUE_GRACE_S:
                return None
        return now.state


def release(job_id: str, requeued_at: str) -> None:
    """``StartTime`` = ``REVOKED_MARGIN_S`` after the requeue (already past: the job starts as soon as Slurm can
    place it). Slurm's tools unreachable, or a time it wrote otherwise: its own hold stands."""
    try:
        start = datetime.datetime.strptime(requeued_at, SLURM_TIME) + datetime.timedelta(seconds=REVOKED_MARGIN_S)
        update = ["scontrol", "update", f"JobId={job_id}", f"StartTime={start.strftime(SLURM_TIME)}"]
        subprocess.run(update, capture_output=True, timeout=30)
    except (ValueError, OSError, subprocess.TimeoutExpired):
        pass
