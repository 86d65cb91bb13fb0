"""How a ``+cluster=slurm`` job's end is reported (``cluster.wait=true``): while the job runs, the head watches for
the ranks' own failure records and reports from them at once (``first_failure``), without waiting for Slurm to
tear the job down (its ``KillWait``, 30 s by default); once the job has ended, ``report`` adds submitit's word for
the tasks that ended without a record, each named with its real node and host (Slurm's block distribution: task
``r`` runs on the ``r // tasks_per_node``-th node of the job's node list)."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from typing import Any

from launcher.base.errors import Kind
from launcher.base.liveness import AFTER_FAILURE_GRACE_S, SLURM_RESULTS_WAIT_S, SLURM_SETTLE_S
from launcher.config import JobConfig
from launcher.report.failures import Failure, load_newest
from launcher.report.failures import print_report as report_failures


def failure_recorded(job: JobConfig, job_id: str) -> bool:
    """A rank of the job's newest start has recorded its own failure (an error, a hang named by the watch): the job
    is ending, the report need not wait. Peers' records alone do not count: a rank killed without a record (by a
    signal, the OOM killer) is named from submitit's word once the job has ended, first."""
    return any(f.kind is not Kind.peer for f in load_newest(job.run, job_id))


def report_first_failure(job: JobConfig, job_id: str) -> int:
    """The report from the ranks' records, once they stopped coming (``SLURM_SETTLE_S`` without a new one, at most
    ``AFTER_FAILURE_GRACE_S``): exit code 1. Slurm ends the other tasks (srun's ``--kill-on-bad-exit``)."""
    deadline, tick = time.monotonic() + AFTER_FAILURE_GRACE_S, threading.Event()
    seen = len(load_newest(job.run, job_id))
    while time.monotonic() < deadline and not tick.wait(SLURM_SETTLE_S):
        now = len(load_newest(job.run, job_id))
        if now == seen:
            break
        seen = now
    report_failures(job.run, job_id)
    return 1


def job_hosts(job_id: str) -> list[str]:
    """The job's nodes, in Slurm's order (``sacct``'s node list, expanded by ``scontrol show hostnames``); [] when
    Slurm cannot say."""
    try:
        listed = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "NodeList"], capture_output=True, text=True, timeout=60
        ).stdout.split()
        if not listed or listed[-1] in ("", "None", "None assigned"):
            return []
        names = subprocess.run(
            ["scontrol", "show", "hostnames", listed[-1]], capture_output=True, text=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []
    return names


SRUN_SAYS = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")


def ended_on_their_own(text: str) -> dict[int, tuple[str, str]]:
    """The tasks srun saw end before it terminated the step (``--kill-on-bad-exit``), from its lines in the job's
    output (``srun: error: node2: task 3: Killed``): rank -> (host, how). The tasks it ended after that are not."""
    found: dict[int, tuple[str, str]] = {}
    for line in text.splitlines():
        if "Terminating StepId" in line or "Job step aborted" in line:
            break
        if said := SRUN_SAYS.match(line.strip()):
            for part in said.group(2).split(","):
                first, _, last = part.partition("-")
                for rank in range(int(first), int(last or first) + 1):
                    found[rank] = (said.group(1), said.group(3))
    return found


def tasks_run(job: JobConfig, hosts: list[str]) -> int:
    """How many tasks (ranks) the job's last start ran: ``procs_per_node`` on each node Slurm gave it (under
    ``cluster.min_nodes``: the nodes ``sacct`` lists; if it lists none, ``cluster.nodes``)."""
    c = job.cluster
    nodes = (len(hosts) or c.nodes) if c.may_shrink else c.nodes
    return nodes * (c.procs_per_node or 1)


def report(submitted: Any, job: JobConfig, state: str | None = None) -> int:
    """0 when every task of the job's last start returned; else the job's failure report (``launcher.report.failures``):
    the ranks' own records, and submitit's word for the tasks that ended without one (killed, or never started),
    each on its real node and host. ``state``: the job's final state as the controller said it (``job_state``);
    None: submitit's (accounting's) word."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    job_id = str(submitted.job_id)
    state = state or str(submitted.state)
    hosts = job_hosts(job_id)
    per_node, tasks = job.cluster.procs_per_node or 1, tasks_run(job, hosts)

    def failure(rank: int, kind: Kind, summary: str) -> Failure:
        node = rank // per_node
        host = hosts[node] if node < len(hosts) else "?"
        task = f"task {rank} of Slurm job {job_id}, state {state}"
        return Failure(rank=rank, kind=kind, summary=summary, host=host, node=node, nodes=len(hosts) or 1, task=task)

    known = []
    results = [submitted.task(rank) for rank in range(tasks)]
    try:  # srun's own lines go to the job's output: the first task's log
        own = ended_on_their_own(results[0].paths.stderr.read_text(errors="replace")) if results else {}
    except OSError:
        own = {}
    deadline, tick = time.monotonic() + SLURM_RESULTS_WAIT_S, threading.Event()
    while not all(t.paths.result_pickle.exists() for t in results) and not tick.wait(0.1):
        if time.monotonic() >= deadline:
            break
    failed = state != "COMPLETED"  # a completed job's results are all coming: submitit waits for them
    for rank, task in enumerate(results):
        if failed and rank in own:  # ended on its own without a record (a signal, the OOM killer): the cause
            known.append(failure(rank, Kind.died, f"srun: task {rank} on {own[rank][0]}: {own[rank][1]}"))
            continue
        if failed and not task.paths.result_pickle.exists():  # killed (srun ends the others after a failure)
            summary = f"Job {job_id} (task: {rank}) has not produced any output (state: {state})"
            known.append(failure(rank, Kind.stopped, summary))
            continue
        try:
            task.result()
        except (FailedJobError, UncompletedJobError) as exc:
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            kind = Kind.died if isinstance(exc, FailedJobError) else Kind.stopped
            known.append(failure(rank, kind, first.strip()))
    if not known:
        return 0
    report_failures(job.run, job_id, known)
    return 1
