"""Inside a Slurm task: one rank of a job, whether ``+cluster=slurm`` submitted it (``SlurmTask``, pickled by
submitit) or a user's sbatch script runs ``srun python -m launcher [overrides]`` (``SlurmTaskMode``: each task
composes the config from the same command line; rank 0 writes it into the run dir, ``runs/slurm-<job id>`` by
default, so a requeued job finds its checkpoints). Either way ``run_slurm_rank``: SIGUSR2 stops every rank at one
step with a checkpoint, then rank 0 requeues the job (and, under ``cluster.min_nodes``, asks for MIN-MAX nodes again).
A ``script=`` has no step to agree on: on SIGUSR2 rank 0 requeues the job at once, and Slurm's SIGTERM that ends it
gives the script its own handler's time to save and exit (Slurm's KillWait, 30 s by default, then SIGKILL); a
task whose script ended after it leaves for the requeue.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from launcher.base.env import DistEnv
from launcher.base.errors import Kind, LauncherError
from launcher.base.files import write_json_atomic
from launcher.config import ClusterConfig, JobConfig, SlurmClusterConfig, load_frozen
from launcher.launch.mode import StartedMode
from launcher.launch.ports import port_in_use
from launcher.trust.secret import Secret

if TYPE_CHECKING:
    from launcher.train.stop import Stopped

log = logging.getLogger(__name__)


class Requeued(LauncherError):
    """Every rank stopped at one step with a checkpoint and this task leaves the job to Slurm: rank 0 requeued it
    (it comes back and resumes), or, the launcher's head having asked for the stop, it ends there, not requeued.
    The task ends 0 with no failure record and no result (``Kind.requeued``)."""

    kind = Kind.requeued


class SlurmTaskMode(StartedMode):
    name = "slurm-task"
    source = "slurm"
    starter = "srun"
    layout_flags = "-N/--ntasks-per-node"
    store_host = "rank 0 hosts the store"

    def run_rank(self, job: JobConfig, env: DistEnv) -> Any:
        try:
            return run_slurm_rank(job, env, composed_here=True)
        except Requeued:
            return None  # (exit 0, set by the rank's entry; no summary: the job comes back, or ended as asked)


def node_range(c: ClusterConfig) -> str:
    """``--nodes`` as Slurm reads it: ``MAX``, or ``MIN-MAX`` under ``cluster.min_nodes``."""
    return f"{c.min_nodes}-{c.nodes}" if c.may_shrink else str(c.nodes)


class SlurmTask:
    """What each Slurm task runs (pickled by submitit into the job's submitit folder, which only its owner can
    read): one rank of the frozen job, with the job's secret (``launcher.trust.secret``; the same after a requeue)
    and the submitter's umask (``files.run_umask``: a task starts under Slurm's, which need not be the user's)."""

    def __init__(self, run_dir: str, secret: Secret, umask: int) -> None:
        self.run_dir = run_dir
        self.secret = secret.environ()
        self.umask = umask

    def __call__(self) -> Any:
        slurms = os.umask(self.umask)  # before the rank makes any file
        try:
            return self.run()
        finally:  # submitit's own files after it (the result pickle) get the umask the task started under: Slurm
            os.umask(slurms)  # carries sbatch's, private (``submit.private_files``) like the rest of their folder

    def run(self) -> Any:
        # submitit's handler ignores SIGTERM (it bypasses it for its own preemption handling): srun's SIGTERM, when a
        # task failed (--kill-on-bad-exit) or the job is cancelled, would then end this rank only at SIGKILL, after
        # Slurm's KillWait (30 s by default). The launcher's own stop request on Slurm is SIGUSR2 (slurm.py)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(self.secret)  # the rank takes it out of its environment (rank.work)
        try:
            return run_slurm_rank(load_frozen(self.run_dir), DistEnv.resolve())
        except Requeued:
            # submitit writes a result for whatever returns or raises an Exception, and a result says the job is
            # done (``Job.done``): a task leaving for a requeue must leave none, so it leaves the way submitit
            # lets through untouched (exit 0, set by the rank's entry)
            raise SystemExit(0) from None


def run_slurm_rank(job: JobConfig, env: DistEnv, composed_here: bool = False) -> Any:
    """One rank inside a Slurm job (ours via submitit, or a user's sbatch + srun, where every task composed the
    config): SIGUSR2 stops all ranks at one step with a checkpoint, then rank 0 requeues the job."""
    from launcher.rank.entry import rank_main

    if job.cluster.master_port:
        env = dataclasses.replace(env, master_port=job.cluster.master_port)
    if env.is_main:
        check_store_port(env, derived=not job.cluster.master_port)
    # Only SIGUSR2: Slurm warns with it cluster.signal_delay_s ahead of a preemption or the time limit; its
    # SIGTERM that follows is the end, not a request (a script's own handler, if it has one, makes it its stop).
    requeues = requeue_count(job)  # at this start: a requeue made while a script runs counts beyond it

    def leave_if_requeued(job: JobConfig, env: DistEnv, signum: int, end: Any) -> None:
        if requeue_count(job) > requeues:  # its script saved and ended on the requeue's SIGTERM: no result
            raise Requeued(f"the script ended on {signal.Signals(signum).name} ({end.outcome()}): the job is requeued")

    return rank_main(
        job,
        env,
        composed_here=composed_here,
        stop_signals=(signal.SIGUSR2,),
        after_stop=requeue_after_stop,
        task=f"task {env.rank} of Slurm job {env.launch_id}",
        script_warned=lambda: requeue_for_script(job, env),
        after_script_stop=leave_if_requeued,
    )


def requeue_count(job: JobConfig) -> int:
    """The requeues rank 0 asked for so far (``RunDir.requeues``)."""
    path = job.run.requeues
    return int(json.loads(path.read_text())["count"]) if path.exists() else 0


def requeue_for_script(job: JobConfig, env: DistEnv) -> None:
    """Slurm's warning (SIGUSR2) to a ``script=``'s task: rank 0 requeues the job now; Slurm then sends every task
    SIGTERM, the script's stop, and SIGKILL after its KillWait. Not requeued (``cluster.max_requeues``): said, and
    the script runs on until Slurm ends it."""
    if not env.is_main:
        return
    try:
        requeue(job, env, "Slurm's warning (SIGUSR2) to a script=", keep_handlers=True)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        log.warning("%s; the script runs on until Slurm ends it", exc)


def requeue_after_stop(job: JobConfig, env: DistEnv, stop: Stopped) -> None:
    """The stop checkpoint is written: rank 0 requeues; every task leaves (``Requeued``: no task returns a result,
    the job comes back). Unless the launcher's head asked for the stop (``RunDir.stop_request``: it was sent
    SIGTERM, SIGINT or SIGHUP): then the job ends."""
    if job.run.stop_request.exists():
        if env.is_main:
            log.warning("%s: checkpoint written; the launcher's head stopped the job (not requeued)", stop)
        raise Requeued(f"{stop}: the launcher's head stopped the job, not requeued")
    if env.is_main:
        requeue(job, env, stop)
    raise Requeued(f"{stop}: the job is requeued")


def check_store_port(env: DistEnv, derived: bool) -> None:
    """Rank 0 hosts the rendezvous store on MASTER_PORT: if something else holds it, say so, not a timeout."""
    reason = port_in_use("", env.master_port)
    if reason:
        origin = f"derived from job id {env.launch_id} (20000 + id % 20000)" if derived else "cluster.master_port"
        raise RuntimeError(
            f"MASTER_PORT {env.master_port} ({origin}) is taken on {env.hostname}: {reason}; HINT: "
            "resubmit with cluster.master_port=<a free port>"
        )


def requeue(job: JobConfig, env: DistEnv, stop: object, keep_handlers: bool = False) -> None:
    """Rank 0 counts a requeue and asks Slurm for it (after ``stop``: the trainer's ``Stopped``, or why a script's
    job is requeued). ``keep_handlers``: a script's rank (its own SIGTERM handler stays; the commands ignore the
    requeue's SIGTERM themselves)."""
    count_file = job.run.requeues
    count = requeue_count(job)
    c = job.cluster if isinstance(job.cluster, SlurmClusterConfig) else SlurmClusterConfig()  # sbatch: defaults
    if count >= c.max_requeues:
        raise RuntimeError(
            f"{stop}; not requeued: cluster.max_requeues={c.max_requeues} reached. HINT: "
            f"resubmit with hydra.run.dir={job.run_dir} to resume from the checkpoint"
        )
    write_json_atomic(count_file, {"count": count + 1})
    # the requeue ends the job's processes, this one too (SIGTERM, SIGKILL after Slurm's KillWait): it is leaving
    # anyway, and what follows (the log line, the node range asked again, in a child that inherits this) must not be
    # cut short
    wrap = ignoring_term if keep_handlers else list
    if not keep_handlers:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.run(wrap(["scontrol", "requeue", env.launch_id]), check=True, timeout=60)
    done = "the script gets Slurm's SIGTERM" if keep_handlers else "checkpoint written"
    log.warning("%s: %s, job %s requeued (%d/%d)", stop, done, env.launch_id, count + 1, c.max_requeues)
    if c.may_shrink:
        ask_node_range_again(c, env, wrap)


def ignoring_term(argv: list[str]) -> list[str]:
    """``argv`` run so that it ignores SIGTERM (a script's rank keeps its own handler: its child cannot inherit
    an ignored SIGTERM from it)."""
    return ["sh", "-c", 'trap "" TERM; exec "$@"', "sh", *argv]


def ask_node_range_again(c: ClusterConfig, env: DistEnv, wrap: Callable[[list[str]], list[str]] = list) -> None:
    """Slurm (22.05) keeps a requeued job at the node and task counts of its last start (2 nodes x 2 tasks stays
    4 tasks, which need 2 nodes): ask for ``MIN-MAX`` again. The job is pending from the requeue on, and not
    eligible to start for some seconds, so the request is in place before the scheduler looks at it."""
    per_node = c.procs_per_node or env.local_world_size
    update = [
        "scontrol",
        "update",
        f"JobId={env.launch_id}",
        f"NumNodes={node_range(c)}",
        f"NumTasks={(c.min_nodes or c.nodes) * per_node}",
    ]
    done = subprocess.run(wrap(update), capture_output=True, text=True, timeout=60)
    if done.returncode:
        log.warning(
            "the requeued job keeps its %d node(s): `%s` failed (exit %d): %s",
            env.num_nodes,
            " ".join(update),
            done.returncode,
            done.stderr.strip(),
        )
