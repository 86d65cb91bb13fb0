"""``+cluster=slurm``: submit through submitit, one Slurm task per rank (no torchrun inside tasks); what runs
inside each task is ``slurm/task_entry.py``.

- The config was frozen into the run dir on this host; every task reads it back (shared filesystem).
- Inside a task the DistEnv comes from SLURM_*: MASTER_ADDR is the job's first node, MASTER_PORT is derived
  from the job id (``cluster.master_port`` overrides it).
- Preemption / time limit: Slurm (or ``scancel --signal=USR2``) sends SIGUSR2; every rank stops at the same step,
  one checkpoint is written, rank 0 requeues the job (``scontrol requeue``), and the requeued job resumes from
  that checkpoint in the same run dir (at most ``cluster.max_requeues`` times). This replaces submitit's own
  handler, which would requeue from inside a signal handler without the other ranks agreeing on a step.
- ``cluster.wait=true``: stream rank 0's log until the job ends, then report (``slurm/ending.py``); the exit code
  is the job's. A rank's failure record is reported at once, while Slurm tears the job down.
- ``cluster.min_nodes`` < ``cluster.nodes``: submitted with ``--nodes=MIN-MAX``, so the job starts as soon as MIN
  nodes are free and gets as many as Slurm can give then (up to MAX); each start (a requeue too) runs
  ``procs_per_node`` tasks on each node it got, and the job resumes its checkpoint on that world size.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.base.env import DistEnv
from launcher.base.files import private_files, run_umask, write_json_atomic
from launcher.base.liveness import SLURM_POLL_S
from launcher.config import ConfigError, JobConfig, SlurmClusterConfig
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.launch.nodes.control import Control, forwarding_stops
from launcher.launch.slurm.ending import failure_recorded, report, report_first_failure
from launcher.launch.slurm.job_state import JobWatch, live
from launcher.launch.slurm.task_entry import SlurmTask, node_range
from launcher.report.stops import print_stopped
from launcher.trust.secret import Secret

log = logging.getLogger(__name__)


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
        submitted = submit_slurm(plan, job)
        return PendingJob(submitted, job, JobWatch(submitted, job.run))


@dataclass
class PendingJob:
    """A submitted job a sweep waits for: ``done()``, then ``finish()`` reports it and gives its exit code."""

    submitted: Any
    job: JobConfig
    watch: JobWatch
    stopped_by: int = 0  # the stop signal passed on to it (``stop``): it ends stopped, not failed

    @property
    def job_id(self) -> str:
        return str(self.submitted.job_id)

    def done(self) -> bool:
        return self.watch.ended() is not None

    def finish(self) -> int:
        if self.stopped_by:  # (its ranks ended on the stop: no failure to report)
            print_stopped(128 + self.stopped_by, self.job, self.job_id)
            return 128 + self.stopped_by
        return report(self.submitted, self.job, self.watch.ended())

    def stop(self, word: Control) -> None:
        """Stop the job as a stop signal to its head would (``stop_job``)."""
        self.stopped_by = int(word.signum)
        stop_job(self.job, self.job_id, word)


def executor(job: JobConfig) -> Any:
    """A submitit executor carrying every Slurm parameter of ``cluster``."""
    import submitit

    c = job.cluster
    if not isinstance(c, SlurmClusterConfig):
        raise TypeError(f"cluster.kind={c.kind!r}: the Slurm launcher needs +cluster=slurm")
    ex = submitit.AutoExecutor(folder=job.run.submitit_jobs(c.folder), cluster="slurm")
    additional = dict(c.extra_sbatch)
    if c.may_shrink:
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


def sbatch_preview(job: JobConfig) -> str:
    """The sbatch script submitit would submit (dry run)."""
    slurm = executor(job)._executor
    return slurm._make_submission_file_text(slurm._submitit_command_str, "<uid>")


def submit_slurm(plan: LaunchPlan, job: JobConfig) -> Any:
    """Submit; Slurm's refusal (bad partition, account, ...) becomes a ConfigError with Slurm's reason."""
    from submitit.core.utils import FailedJobError

    job.run.stop_request.unlink(missing_ok=True)  # an earlier run's stop is not this one's

    try:
        ex, c = executor(job), job.cluster
        assert isinstance(c, SlurmClusterConfig)  # (executor refuses any other)
        task = SlurmTask(job.run_dir, Secret.new(), run_umask())  # (the user's umask, before private_files)
        private = job.run.submitit(c.folder)  # the pickled task carries the job's secret: its owner's only
        with private_files():  # (the folder, and each file submitit writes in it: 0700, 0600)
            private.mkdir(parents=True, exist_ok=True)
            private.chmod(0o700)  # (an earlier run's)
            submitted = ex.submit(task)
    except (FailedJobError, subprocess.CalledProcessError, OSError) as exc:
        raise ConfigError(f"Slurm refused the job: {str(exc).strip()}") from None
    layout = f"{plan.world_size} task(s) on {plan.nodes} node(s)"
    if plan.may_shrink:
        layout = (
            f"{plan.min_nodes * plan.procs_per_node}-{plan.world_size} task(s) on {node_range(job.cluster)} node(s) "
            "(cluster.min_nodes: as many nodes as are free when it starts)"
        )
    print(
        f"[launcher] submitted Slurm job {submitted.job_id}: {layout}\n"
        f"[launcher] rank 0 log: {job.run.rank_log(0)}\n"
        f"[launcher] submitit files: {submitted.paths.folder}",
        file=sys.stderr,
    )
    return submitted


def launch_slurm(plan: LaunchPlan, job: JobConfig) -> int:
    submitted = submit_slurm(plan, job)
    if isinstance(job.cluster, SlurmClusterConfig) and not job.cluster.wait:
        return 0
    job_id, watch = str(submitted.job_id), JobWatch(submitted, job.run)
    stop = lambda word: stop_job(job, job_id, word)  # noqa: E731
    then = "the ranks checkpoint" if job.script is None else "the script's tasks get SIGTERM, and Slurm's KillWait"
    with forwarding_stops(stop, "on Slurm, no requeue", then) as stops:
        state = stream_until_done(watch, job.run.rank_log(0), lambda: failure_recorded(job, job_id))
    if stops:
        code = 128 + stops[0]  # the head's own signal (SIGHUP is passed on as a SIGTERM)
        print_stopped(code, job, job_id)  # (a script's: how each task ended, as each recorded it)
        return code
    if state is None:
        return report_first_failure(job, job_id)  # while Slurm tears the job down (its KillWait: 30 s by default)
    return report(submitted, job, state)


def stop_job(job: JobConfig, job_id: str, word: Control) -> None:
    """The head was asked to stop (SIGTERM, SIGINT, SIGHUP): the trainer's ranks stop at one step with a checkpoint,
    as on a preemption (SIGUSR2 to every task), but rank 0 does not requeue (``RunDir.stop_request`` says why); a
    ``script=`` job and a job still pending are cancelled (Slurm sends the tasks SIGTERM, the script's stop, and
    SIGKILL after its KillWait). A second stop (``Control.ABORT``) kills every task at once."""
    if word is Control.ABORT:
        how = ["scancel", "--full", "--signal=KILL", job_id]
    else:
        write_json_atomic(job.run.stop_request, {"stop": word.value})
        now = live(job_id)
        cancel = job.script is not None or (now is not None and now.state == "PENDING")
        how = ["scancel", job_id] if cancel else ["scancel", "--signal=USR2", job_id]
    try:
        subprocess.run(how, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"launcher: could not stop Slurm job {job_id} ({' '.join(how)}: {exc}); scancel it", file=sys.stderr)


def stream_until_done(watch: JobWatch, log: Path, failed: Callable[[], bool]) -> str | None:
    """Print rank 0's log as it grows until the job ends (its final state), or until a rank recorded its failure
    (None: the report comes from the records at once, not after Slurm's teardown). The job's state comes from the
    controller at each turn (``SLURM_POLL_S``, ``job_state``)."""
    offset, tick = 0, threading.Event()
    while True:
        state = watch.ended()
        if log.exists():
            with open(log, encoding="utf-8", errors="replace") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            if chunk:
                print(chunk, end="", file=sys.stderr, flush=True)
        if state is not None:
            return state
        if failed():
            return None
        tick.wait(SLURM_POLL_S)
