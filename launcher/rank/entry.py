"""The entry of a rank's process, ``rank_main``: how every in-process path runs one rank to its end, whatever
started the process (what the rank then does is ``rank/work.py``).

- the launcher's elastic agents (local, sim, by hand) start ``python -m launcher.rank.entry RUN_DIR`` per rank;
- under torchrun, or as an srun task of a user's sbatch script, ``python -m launcher`` is already one rank;
- submitit's Slurm tasks call it through ``launcher.launch.slurm.task_entry.SlurmTask``;
- one rank in the launcher's own process (``launcher.launch.local.run_here``) calls it too.

What it does the same way for all: end the process through ``end_process_at_exit`` (no interpreter teardown: see
``launcher.base.exiting``; asked first, so that the atexit handlers a script registers run before that end), write
the config into the run dir when it was composed here (rank 0 only), install the stop handling, and record the
first failure for the job's report (``launcher.report.failures``). The trainer's ranks stop on a signal at an agreed
step with a checkpoint (``train.stop``); a ``script=``'s ranks get the signal itself, as under torchrun
(``rank.script_stop``), and end with the script's own exit code (130 for a Ctrl-C it does not handle), no failure.
What differs is an argument, each with its reason at the call site: which signals stop the rank with a checkpoint,
what happens after that stop (``after_stop``; a script's: ``after_script_stop``), and how the scheduler names the
process. An outcome that ends the rank cleanly (``LeftJob``: out of a job that goes on; ``Requeued``: a Slurm task
leaving for its job's requeue; ``base.errors.ends_cleanly``) is raised on with exit code 0 and no failure record: the
process's own boundary ends it its way.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any, Optional

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, get_error_handler

from launcher.base.env import DistEnv
from launcher.base.errors import ends_cleanly
from launcher.base.exiting import end_process_at_exit
from launcher.base.run_dir import RunDir
from launcher.base.titles import name_process
from launcher.config import JobConfig, freeze, load_frozen
from launcher.config.rules import entry_words
from launcher.rank.script_stop import ScriptSignals
from launcher.rank.work import ScriptExited, run_rank_work
from launcher.report.failures import FailureLog, summarize
from launcher.report.stops import STOP_SIGNALS, RankEnd, record_ends
from launcher.train.stop import Stopped, StopRequest

log = logging.getLogger("launcher.rank.entry")  # not __name__: run as __main__ it would miss the rank log


def end_by_signal(job: JobConfig, env: DistEnv, stop: Stopped) -> None:
    """After a stop checkpoint under an elastic agent: end as the signal asked (the agent is shutting down and
    will not collect a result); the launcher then exits 143 / 130."""
    log.warning("%s: checkpoint written; run again with the same run dir to continue", stop)
    if stop.signum:
        logging.shutdown()
        signal.signal(stop.signum, signal.SIG_DFL)  # (the stop's handler records until the line is written)
        os.kill(os.getpid(), stop.signum)


ScriptStop = Callable[[JobConfig, DistEnv, int, RankEnd], None]  # after a script's rank ended on a stop signal


def rank_main(
    job: JobConfig,
    env: DistEnv,
    *,
    composed_here: bool = False,
    stop_signals: tuple[int, ...] = STOP_SIGNALS,  # under an elastic agent (ours, torchrun): Ctrl-C / SIGTERM
    after_stop: Callable[[JobConfig, DistEnv, Stopped], None] = end_by_signal,
    last_words: Optional[Callable[[int], None]] = None,
    task: str = "",
    after_script_stop: Optional[ScriptStop] = None,
    script_warned: Optional[Callable[[], None]] = None,
) -> Any:
    """Run rank ``env.rank`` of ``job``; returns the trainer's summary (None for a script; the doctor's report; None
    after a stop, once ``after_stop`` returned). ``composed_here``: every rank composed the config from the same
    command line (torchrun, srun), so rank 0 writes it. ``last_words``: said before a stop signal ends the trainer's
    rank at once (outside its loop). A script: ``after_script_stop`` once it ended after a stop signal (the signal,
    how it ended); ``script_warned`` when one of ``stop_signals`` that is no stop signal (Slurm's SIGUSR2) arrives."""
    end_process_at_exit(0)  # first: the atexit handlers registered from here on (a script's) run before this end
    try:
        name_process(f"rank {env.rank}/{env.world_size} node {env.node_rank}", entry_words(job), job.run_dir)
        if composed_here and env.is_main:
            freeze(job)
    except BaseException:
        end_process_at_exit(1)
        raise
    if job.script is not None:
        warnings = tuple(s for s in stop_signals if s not in STOP_SIGNALS)
        signals = ScriptSignals(warnings, script_warned)
        run_script_job(job, env, task, signals, after_script_stop or (lambda *_: None))
        return None
    stop = StopRequest().install(*stop_signals)
    if last_words is not None:
        stop.last_words = last_words
    failures = FailureLog(job.run, env, task=task, on_failure=stop.hold)
    stop.failing = failures.others_failed
    elastic_errors = get_error_handler()  # the error file an elastic agent (torchrun) reads, as @record writes
    elastic_errors.initialize()
    try:
        result = run_rank_work(job, env, stop=stop, failures=failures)
    except BaseException as exc:
        failed(failures, elastic_errors, exc)
        stop.uninstall()
        raise
    if not isinstance(result, Stopped):
        stop.uninstall()
        return result
    try:  # every rank stopped at one step, the checkpoint written: end as the signal asked, or requeue (Slurm)
        after_stop(job, env, result)  # (a stop signal meanwhile, its agent's, is recorded: no end before the line)
    except BaseException as exc:  # a requeue refused (exit 1), or made (Requeued: exit 0, as set above)
        failed(failures, elastic_errors, exc)
        raise
    finally:
        stop.uninstall()
    return None


def run_script_job(job: JobConfig, env: DistEnv, task: str, signals: ScriptSignals, after: ScriptStop) -> None:
    """A ``script=``'s rank: the script gets the stop signals itself (no handler of the launcher's); one that ends
    after one, its own way, ended on a stop: its exit code is its own (its exit status; 130 for a Ctrl-C it does not
    handle: Python's ``KeyboardInterrupt``; 1 for an error, a peer that left first: said in one line), no failure is
    recorded, its end is recorded for the stop line, and ``after`` says what comes next (torchrun's rank 0: the stop
    line; Slurm: leave for the requeue)."""
    failures = FailureLog(job.run, env, task=task, stopped=lambda: signals.seen() is not None)
    elastic_errors = get_error_handler()  # the error file an elastic agent (torchrun) reads, as @record writes
    elastic_errors.initialize()
    code = 0
    signals.install()
    try:
        run_rank_work(job, env, failures=failures)
    except KeyboardInterrupt:  # not recorded as a failure (rank.work): the stop the script left to Python
        log.warning("the script ended on SIGINT (KeyboardInterrupt: it has no handler of its own): exit 130")
        code, signals.first = 128 + signal.SIGINT, signals.first or signal.SIGINT
    except BaseException as exc:
        if signals.seen() is None or ends_cleanly(exc):  # a failure (or a clean end): as any rank's
            signals.uninstall()
            failed(failures, elastic_errors, exc)
            raise
        code = exc.code if isinstance(exc, ScriptExited) else 1  # its own end after the stop (a peer left first)
        log.warning("the script ended after the stop signal with %s: exit %d", summarize(exc), code)
    signum = signals.uninstall()
    end_process_at_exit(code)
    if signum is None:
        return
    end = RankEnd(env.rank, host_of(env), code, env.node_rank)
    ended_on_stop(job, env, end)
    try:
        after(job, env, signum, end)
    except BaseException as exc:  # a Slurm task leaving for its job's requeue (Requeued: exit 0)
        failed(failures, elastic_errors, exc)
        raise


def ended_on_stop(job: JobConfig, env: DistEnv, end: RankEnd) -> None:
    """This rank's end after a stop signal, for the stop line (its agent's record, once it has ended, replaces it)."""
    if env.launch_id:  # (one process the launcher runs itself: it says it at once)
        record_ends(job.run, env.launch_id, env.attempt, [end])


def host_of(env: DistEnv) -> str:
    return env.hostname or socket.gethostname()


def failed(failures: FailureLog, elastic_errors: ErrorHandler, exc: BaseException) -> None:
    """Record ``exc`` (a no-op when recorded inside, before the process group went down; stop signals are
    ignored from then on) and the elastic error file, and make the process end with its exit code: 0 for an
    outcome that ends the rank cleanly (nothing recorded), else 1."""
    if ends_cleanly(exc):
        log.info("%s: this rank ends here (exit 0)", exc)
        end_process_at_exit(0)
        return
    failures.record(exc)
    if isinstance(exc, Exception):
        elastic_errors.record_exception(exc)
    end_process_at_exit(1)


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m launcher.rank.entry RUN_DIR [WORDS...]``: one worker of the launcher's own elastic agents
    (``config.rules.rank_command``; WORDS: what the job runs, for ``ps``). A failure's traceback goes to the rank's
    log, not the console: the launcher prints the job's report, root cause first."""
    run_dir = (sys.argv[1:] if argv is None else argv)[0]
    env = DistEnv.resolve()
    try:
        job = load_frozen(run_dir)
        # torch, Hydra and the launcher (~285,000 objects) live as long as the process: a full collection (the one
        # ending every process group, each one Python makes while the rank trains) walks what the job made only
        gc.freeze()
        rank_main(job, env)
    except BaseException as exc:
        if ends_cleanly(exc):
            return  # (exit 0) out of a job that went on without this rank's machine, once it answered again
        with open(RunDir(run_dir).rank_log(env.rank), "a", encoding="utf-8") as log_file:
            traceback.print_exc(file=log_file)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
