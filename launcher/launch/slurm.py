"""``+cluster=slurm``: submit through submitit, one Slurm task per rank (no torchrun inside tasks).

- The config was frozen into the run dir on this host; every task reads it back (shared filesystem).
- Inside a task the DistEnv comes from SLURM_*: MASTER_ADDR is the job's first node, MASTER_PORT is derived
  from the job id (``cluster.master_port`` overrides it).
- Preemption / time limit: Slurm (or ``scancel --signal=USR2``) sends SIGUSR2; every rank stops at the same step,
  one checkpoint is written, rank 0 requeues the job (``scontrol requeue``), and the requeued job resumes from
  that checkpoint in the same run dir (at most ``cluster.max_requeues`` times). This replaces submitit's own
  handler, which would requeue from inside a signal handler without the other ranks agreeing on a step.
- ``cluster.wait=true``: stream rank 0's log until the job ends, then report; the exit code is the job's.
- ``cluster.min_nodes`` < ``cluster.nodes``: submitted with ``--nodes=MIN-MAX``, so the job starts as soon as MIN
  nodes are free and gets as many as Slurm can give then (up to MAX); each start (a requeue too) runs
  ``procs_per_node`` tasks on each node it got, and the job resumes its checkpoint on that world size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ClusterConfig, ConfigError, JobConfig, SlurmClusterConfig, load_frozen
from ..env import DistEnv
from ..failures import Failure
from ..failures import report as report_failures
from ..files import write_json_atomic
from ..logs import rank_log_path
from .mode import BaseMode
from .plan import LaunchPlan
from .ports import port_in_use

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often the log is streamed and the job state polled while waiting


class SlurmMode(BaseMode):
    name = "slurm"
    batch = True

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        port = job.cluster.master_port or "20000 + job id % 20000"
        return f"Slurm: MASTER_ADDR = the job's first node, MASTER_PORT = {port}"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        return launch_slurm(plan, job)

    def preview(self, job: JobConfig) -> str:
        return "# sbatch script (submitit)\n" + sbatch_preview(job)

    def submit(self, plan: LaunchPlan, job: JobConfig) -> PendingJob:
        return PendingJob(submit_slurm(plan, job), job)


@dataclass(frozen=True)
class PendingJob:
    """A submitted job a sweep waits for: ``done()``, then ``finish()`` reports it and gives its exit code."""

    submitted: Any
    job: JobConfig

    @property
    def job_id(self) -> str:
        return str(self.submitted.job_id)

    def done(self) -> bool:
        return bool(self.submitted.done())

    def finish(self) -> int:
        return report(self.submitted, self.job)


def executor(job: JobConfig):
    """A submitit executor carrying every Slurm parameter of ``cluster``."""
    import submitit

    c = job.cluster
    if not isinstance(c, SlurmClusterConfig):
        raise TypeError(f"cluster.kind={c.kind!r}: the Slurm launcher needs +cluster=slurm")
    ex = submitit.AutoExecutor(folder=Path(job.run_dir) / c.folder / "%j", cluster="slurm")
    additional = dict(c.extra_sbatch)
    if may_shrink(c):
        additional["nodes"] = node_range(c)  # replaces submitit's --nodes=MAX (extra_sbatch cannot set nodes)
    params: dict[str, Any] = dict(
        name=c.job_name,
        nodes=c.nodes,
        tasks_per_node=c.procs_per_node,
        cpus_per_task=c.cpus_per_task,
        timeout_min=c.time_min,
        slurm_signal_delay_s=c.signal_delay_s,
        slurm_additional_parameters=additional,
        slurm_setup=list(c.setup),
        # a rank that fails ends the job at once instead of leaving its peers waiting for collective timeouts
        slurm_srun_args=["--kill-on-bad-exit=1"],
    )
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        if getattr(c, key):
            params[f"slurm_{key}"] = getattr(c, key)
    if c.gpus_per_node:
        params["slurm_gres"] = f"gpu:{c.gpus_per_node}"
    if c.mem_gb:
        params["mem_gb"] = c.mem_gb
    ex.update_parameters(**params)
    return ex


def may_shrink(c: ClusterConfig) -> bool:
    return c.fewest_nodes < c.nodes


def node_range(c: ClusterConfig) -> str:
    """``--nodes`` as Slurm reads it: ``MAX``, or ``MIN-MAX`` under ``cluster.min_nodes``."""
    return f"{c.fewest_nodes}-{c.nodes}" if may_shrink(c) else str(c.nodes)


def tasks_run(submitted: Any, job: JobConfig) -> int:
    """How many tasks (ranks) the job's last start ran: ``procs_per_node`` on each node Slurm gave it (under
    ``cluster.min_nodes`` the count comes from the accounting, ``sacct``; if it has none, ``cluster.nodes``)."""
    c = job.cluster
    per_node = c.procs_per_node or 1
    if not may_shrink(c):
        return c.nodes * per_node
    try:
        out = subprocess.run(
            ["sacct", "-j", str(submitted.job_id), "-X", "-n", "-P", "-o", "NNodes"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    nodes = int(out[-1]) if out and out[-1].isdigit() and int(out[-1]) > 0 else c.nodes
    return nodes * per_node


def sbatch_preview(job: JobConfig) -> str:
    """The sbatch script submitit would submit (dry run)."""
    slurm = executor(job)._executor
    return slurm._make_submission_file_text(slurm._submitit_command_str, "<uid>")


class SlurmTask:
    """What each Slurm task runs (pickled by submitit): one rank of the frozen job."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> Any:
        return run_slurm_rank(load_frozen(self.run_dir), DistEnv.resolve())


def run_slurm_rank(job: JobConfig, env: DistEnv, composed_here: bool = False) -> Any:
    """One rank inside a Slurm job (ours via submitit, or a user's sbatch + srun, where every task composed the
    config): SIGUSR2 stops all ranks at one step with a checkpoint, then rank 0 requeues the job."""
    from ..rank import rank_main

    if job.cluster.master_port:
        env = dataclasses.replace(env, master_port=job.cluster.master_port)
    if env.is_main:
        check_store_port(env, derived=not job.cluster.master_port)
    # Only SIGUSR2: Slurm warns with it cluster.signal_delay_s ahead of a preemption or the time limit; its
    # SIGTERM that follows is the end, not a request.
    return rank_main(
        job,
        env,
        composed_here=composed_here,
        stop_signals=(signal.SIGUSR2,),
        after_stop=requeue_after_stop,
        task=f"task {env.rank} of Slurm job {env.job_id}",
    )


def requeue_after_stop(job: JobConfig, env: DistEnv, exc: Exception) -> None:
    """The stop checkpoint is written: rank 0 requeues; no task returns a result (the job comes back)."""
    if env.is_main:
        requeue(job, env, exc)
    raise SystemExit(0)


def check_store_port(env: DistEnv, derived: bool) -> None:
    """Rank 0 hosts the rendezvous store on MASTER_PORT: if something else holds it, say so, not a timeout."""
    reason = port_in_use("", env.master_port)
    if reason:
        origin = f"derived from job id {env.job_id} (20000 + id % 20000)" if derived else "cluster.master_port"
        raise RuntimeError(
            f"MASTER_PORT {env.master_port} ({origin}) is taken on {env.hostname}: {reason}; HINT: "
            "resubmit with cluster.master_port=<a free port>"
        )


def requeue(job: JobConfig, env: DistEnv, exc: Exception) -> None:
    count_file = Path(job.run_dir) / "requeues.json"
    count = json.loads(count_file.read_text())["count"] if count_file.exists() else 0
    c = job.cluster if isinstance(job.cluster, SlurmClusterConfig) else SlurmClusterConfig()  # sbatch: defaults
    if count >= c.max_requeues:
        raise RuntimeError(
            f"{exc}; not requeued: cluster.max_requeues={c.max_requeues} reached. HINT: "
            f"resubmit with hydra.run.dir={job.run_dir} to resume from the checkpoint"
        )
    write_json_atomic(count_file, {"count": count + 1})
    # the requeue ends the job's processes, this one too (SIGTERM, SIGKILL after Slurm's KillWait): it is leaving
    # anyway, and what follows (the log line, the node range asked again, in a child that inherits this) must not be
    # cut short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.run(["scontrol", "requeue", env.job_id], check=True, timeout=60)
    log.warning("%s: checkpoint written, job %s requeued (%d/%d)", exc, env.job_id, count + 1, c.max_requeues)
    if may_shrink(c):
        ask_node_range_again(c, env)


def ask_node_range_again(c: ClusterConfig, env: DistEnv) -> None:
    """Slurm (22.05) keeps a requeued job at the node and task counts of its last start (2 nodes x 2 tasks stays
    4 tasks, which need 2 nodes): ask for ``MIN-MAX`` again. The job is pending from the requeue on, and not
    eligible to start for some seconds, so the request is in place before the scheduler looks at it."""
    per_node = c.procs_per_node or env.local_world_size
    update = [
        "scontrol",
        "update",
        f"JobId={env.job_id}",
        f"NumNodes={node_range(c)}",
        f"NumTasks={c.fewest_nodes * per_node}",
    ]
    done = subprocess.run(update, capture_output=True, text=True, timeout=60)
    if done.returncode:
        log.warning(
            "the requeued job keeps its %d node(s): `%s` failed (exit %d): %s",
            env.num_nodes,
            " ".join(update),
            done.returncode,
            done.stderr.strip(),
        )


def submit_slurm(plan: LaunchPlan, job: JobConfig):
    """Submit; Slurm's refusal (bad partition, account, ...) becomes a ConfigError with Slurm's reason."""
    from submitit.core.utils import FailedJobError

    try:
        submitted = executor(job).submit(SlurmTask(job.run_dir))
    except (FailedJobError, subprocess.CalledProcessError, OSError) as exc:
        raise ConfigError(f"Slurm refused the job: {str(exc).strip()}") from None
    layout = f"{plan.world_size} task(s) on {plan.nodes} node(s)"
    if plan.min_nodes < plan.nodes:
        layout = (
            f"{plan.min_nodes * plan.procs_per_node}-{plan.world_size} task(s) on {node_range(job.cluster)} node(s) "
            "(cluster.min_nodes: as many nodes as are free when it starts)"
        )
    print(
        f"[launcher] submitted Slurm job {submitted.job_id}: {layout}\n"
        f"[launcher] rank 0 log: {rank_log_path(job.run_dir, 0)}\n"
        f"[launcher] submitit files: {submitted.paths.folder}",
        file=sys.stderr,
    )
    return submitted


def launch_slurm(plan: LaunchPlan, job: JobConfig) -> int:
    submitted = submit_slurm(plan, job)
    if isinstance(job.cluster, SlurmClusterConfig) and not job.cluster.wait:
        return 0
    stream_until_done(submitted, rank_log_path(job.run_dir, 0))
    return report(submitted, job)


def stream_until_done(submitted, log: Path) -> None:
    """Print rank 0's log as it grows until the job ends (submitit polls sacct for the state)."""
    offset, tick = 0, threading.Event()
    while True:
        done = submitted.done()
        if log.exists():
            with open(log, encoding="utf-8", errors="replace") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            if chunk:
                print(chunk, end="", file=sys.stderr, flush=True)
        if done:
            return
        tick.wait(POLL_S)


def report(submitted, job: JobConfig) -> int:
    """0 when every task of the job's last start returned; else the job's failure report (``launcher.failures``):
    the ranks' own records, and submitit's word for the tasks that ended without one (killed, or never started)."""
    from submitit.core.utils import FailedJobError, UncompletedJobError

    known = []
    for rank in range(tasks_run(submitted, job)):
        try:
            submitted.task(rank).result()
        except (FailedJobError, UncompletedJobError) as exc:
            first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            kind = "died" if isinstance(exc, FailedJobError) else "stopped"
            known.append(
                Failure(
                    rank=rank,
                    kind=kind,
                    summary=first.strip(),
                    task=f"task {rank} of Slurm job {submitted.job_id}, state {submitted.state}",
                )
            )
    if not known:
        return 0
    report_failures(job.run_dir, str(submitted.job_id), known)
    return 1
