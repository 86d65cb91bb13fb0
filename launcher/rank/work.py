"""What every rank does (``run_rank_work``, called by ``rank.entry.rank_main``), whichever launcher started it:
resolve the DistEnv once, set up logging and the device, open the process group, then train (or run the user's
script), and always close the group."""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from launcher.base.devices import rank_device
from launcher.base.env import HEAD_ATTEMPT, TORCHRUN_VARS, DistEnv
from launcher.base.errors import LauncherError
from launcher.base.faults import faults_for
from launcher.base.logs import setup_logging
from launcher.base.threads import for_this_rank
from launcher.config import JobConfig, SlurmClusterConfig, collective_timeout_s
from launcher.config.rules import job_backend
from launcher.engine.settings import hand_over
from launcher.group.helpers import Peers
from launcher.group.rendezvous import listening_store, process_group
from launcher.heal.rank_side import Healer
from launcher.report.attempts import mark_start
from launcher.report.failures import FailureLog
from launcher.report.summary import RunSummary
from launcher.train.stop import Stopped, StopRequest
from launcher.trust.secret import Secret
from launcher.watch import ProgressWatch, backstop_s, start_watch

log = logging.getLogger(__name__)


def run_rank_work(
    job: JobConfig, env: DistEnv, stop: StopRequest | None = None, failures: FailureLog | None = None
) -> RunSummary | Stopped | dict | None:
    """Run one rank of ``job``. Returns the trainer's summary, or ``Stopped`` (a stop signal: every rank stopped at
    one step with a checkpoint); the doctor's report with ``doctor=true``; None for a user script. ``failures``
    records an error the moment it is caught, before the process group (ours, or the script's as long as it does
    not tear it down itself) goes down and makes the peers fail."""
    failures = failures or FailureLog(job.run, env)
    mark_attempt(setup_logging(job.run, env), env)
    if env.local_rank == 0:  # this node's start of this attempt (summary.json's attempts)
        mark_start(job.run, env)
    c = job.comm
    # a script's job without comm.timeout_s: the watch names a hang and leaves the end to the script's own group
    ends = c.timeout_s is not None or job.script is None
    timeout_s = collective_timeout_s(c) if ends else None
    watch = start_watch(job.run, env, c.hang_warn_s, timeout_s, c.flight_recorder_entries)
    how = "raised"
    try:
        result = _run(job, env, stop, failures, watch)
        how = "returned"
        return result
    finally:
        watch.end(how)  # the round's watch when the job healed in place


def mark_attempt(log_file: Path, env: DistEnv) -> None:
    """Where this attempt's output starts in the rank's log: a restarted job (or one run again in its run dir)
    appends to the same log, and its attempts read apart by this line (summary.json's ``attempts`` by number)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    where = f"rank {env.rank}/{env.world_size}, node {env.node_rank}, on {env.hostname or socket.gethostname()}"
    with open(log_file, "a", encoding="utf-8") as log_lines:
        log_lines.write(f"==== attempt {env.attempt} (launch {env.launch_id or '-'}): {where}, {when} ====\n")


def _run(
    job: JobConfig, env: DistEnv, stop: StopRequest | None, failures: FailureLog, watch: ProgressWatch
) -> RunSummary | Stopped | dict | None:
    secret = Secret.from_environ(os.environ)  # the job's (the launcher's head handed it on): out of the environment
    threads, why = for_this_rank(job.train.threads_per_rank, env.local_world_size)  # the script's too
    torch.set_num_threads(threads)
    if job.script is not None:
        hand_over(job, secret, watch)  # what a launcher.Engine in the script reads (engine/settings.py)
        run_script_rank(job, job.script, env, threads, failures)
        return None
    from launcher.train.trainer import Trainer  # heavy imports only where training happens

    backend = job_backend(job)
    device = rank_device(env.local_rank, use_gpu=bool(job.cluster.gpus_per_node))
    signed = "signed with the job's secret" if secret else "unsigned (no LAUNCHER_SECRET: docs/security.md)"
    log.info("%s, device %s, backend %s, %d thread(s), store %s", env.describe(), device, backend, threads, signed)
    log.debug("threads per rank: %s", why)
    if env.is_main and job.cluster.may_shrink:  # sim, ssh after a loss; Slurm's --nodes=MIN-MAX
        log.info(
            "running on %d node(s) of the %d-%d allowed (cluster.min_nodes, cluster.nodes): %d rank(s)",
            env.num_nodes,
            job.cluster.min_nodes,
            job.cluster.nodes,
            env.world_size,
        )
    if (fault := faults_for(env).get(0)) is not None:  # LAUNCHER_FAULT step=0: before joining
        fault.fire()
    healer = Healer.from_environ(job.cluster.lost_after_s, backend, secret)  # (None: a job that does not heal)
    joins = healer is not None and healer.joins  # its group forms when the keeper lets it in
    timeout_s, join_s = backstop_s(job.comm), job.cluster.join_timeout_s
    grouping = process_group(env, backend, timeout_s, join_timeout_s=join_s, form=not joins, secret=secret)
    with grouping as group, failures.catching():
        if job.doctor or job.preflight:
            from launcher.rank.doctor import run_doctor

            report = run_doctor(
                env,
                device,
                job.run,
                device.type == "cuda",
                log_report=job.preflight,
                timeout_s=collective_timeout_s(job.comm),
                peers=Peers(secret=secret),
            )
            if job.doctor:
                return report
        return Trainer(job, env, device, backend, group, stop, secret, watch, healer).fit()


def run_script_rank(job: JobConfig, script: str, env: DistEnv, threads: int, failures: FailureLog) -> None:
    """One rank of a ``script=`` job: ``script`` runs in this process with every variable torchrun gives a worker,
    with torchrun's meaning, whichever launcher started this rank (docs/running.md: torchrun's environment)."""
    store = None  # rank 0 hosts the script's env:// store, listening on MASTER_ADDR only (one rank too: torchrun's
    if env.rank == 0 and not env.agent_store:  # agent hosts one for --nproc_per_node=1)
        store = listening_store(env.master_addr, env.master_port)
        env = dataclasses.replace(env, master_port=store.port)  # port 0 (one process): the one it took
    if not env.launch_id:  # one process the launcher runs itself: a run id of its own, as torchrun --standalone
        env = dataclasses.replace(env, launch_id=uuid.uuid4().hex[:12])
    os.environ.update(env.torchrun_environ(restarts_allowed(job, env), threads))
    os.environ.setdefault(TORCHRUN_VARS["nccl_async_errors"], "1")  # torchrun's agent's default, the user's kept
    os.environ.pop(HEAD_ATTEMPT, None)  # counted in TORCHELASTIC_RESTART_COUNT: not twice in a DistEnv of its own
    try:
        run_script(script, job.script_args)
    except KeyboardInterrupt:
        raise  # Python's answer to a Ctrl-C the script does not handle itself: a stop (``rank.entry``), no failure
    except BaseException as exc:
        failures.record(exc)  # before the script's group goes down with this process and its peers fail
        raise
    finally:
        del store


def restarts_allowed(job: JobConfig, env: DistEnv) -> int:
    """How many times this rank's job may be started again (a script's TORCHELASTIC_MAX_RESTARTS): what the elastic
    agent that started it says (torchrun's ``--max-restarts``, our local and simulated nodes' agents); a Slurm job
    is started again when it is requeued, never after a failure: ``cluster.max_requeues`` (the requeues so far are
    the attempt); one process the launcher runs itself is never restarted: 0; else the launcher's head restarts
    the job (ssh, sim under ``cluster.min_nodes``): ``cluster.max_restarts``."""
    if env.max_restarts is not None:
        return env.max_restarts
    if env.source == "slurm":  # a user's sbatch composes no Slurm cluster: its requeues are the defaults' (task_entry)
        c = job.cluster
        return c.max_requeues if isinstance(c, SlurmClusterConfig) else SlurmClusterConfig().max_requeues
    return 0 if env.source == "single" else job.cluster.max_restarts


def run_script(script: str, args: list[str]) -> None:
    """Run a torchrun-compatible script as ``__main__`` in this process: it reads RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT (already set by the launcher) and calls init_process_group itself."""
    path = str(Path(script).resolve())
    sys.argv = [path, *args]
    sys.path.insert(0, str(Path(path).parent))
    said = LastLine(sys.stderr)
    sys.stderr = said  # (a stand-in that passes every write on)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            if not isinstance(exc.code, int):  # sys.exit("message"): Python would print it, and exit 1
                print(exc.code, file=sys.stderr)
            raise ScriptExited(script, exc.code, said.last()) from None
    finally:
        if sys.stderr is said:
            sys.stderr = said.stream


class LastLine:
    """``sys.stderr`` while a script runs: every write passed on as it comes, the last line that says something kept
    (argparse's ``error: ...`` before its exit 2: the report names it)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.line, self.pending = stream, "", ""

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        *lines, self.pending = (self.pending + text).split("\n")
        self.pending = self.pending[-LAST_LINE_CHARS:]
        self.line = next((line.strip() for line in reversed(lines) if line.strip()), self.line)[:LAST_LINE_CHARS]
        return written

    def last(self) -> str:
        return self.pending.strip() or self.line

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, buffer...: the stream's own
        return getattr(self.stream, name)


LAST_LINE_CHARS = 300  # of the script's last line on stderr, in its failure's summary


class ScriptExited(LauncherError):
    """The script ended with a non-zero exit status (``sys.exit(N)``; a message: 1, as Python exits): a failure,
    unless a stop signal came first (``rank.entry``: then its exit code, said). Its message names the status and
    the script's own last line on stderr (the error it exited on), which the job's report shows."""

    def __init__(self, script: str, code: object, said: str = "") -> None:
        self.code = code if isinstance(code, int) else 1
        why = f"; its last line on stderr: {said}" if said else " (it wrote nothing on stderr)"
        super().__init__(f"script {script} exited with status {self.code}{why}")
