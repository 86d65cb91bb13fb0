"""Stopping a job on a signal, in words every mode shares: which signals stop a job (``STOP_SIGNALS``: sent to its
head alone, or to a rank; torchrun's too), the exit codes of a rank or head that stopped on one (``STOP_CODES``:
128 + the signal), and the one line a stopped job ends with (``stop_message``), whichever mode ran it. How a head
passes a stop on to its nodes is the launch mode's (``launch/nodes/attempts.py``); how the ranks agree on a step to
stop at is the trainer's (``train/stop.py``). No torch here."""

from __future__ import annotations

import signal
import sys

from launcher.base.checkpoint_names import newest, step_of
from launcher.base.run_dir import RunDir
from launcher.config import JobConfig

# what stops a job, sent to its head alone (a user's kill, a CI runner, a scheduler; Ctrl-C reaches the group) or
# to a rank (the trainer's ranks stop at an agreed step with a checkpoint)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_CODES = tuple(128 + s for s in STOP_SIGNALS)  # a rank or a head that stopped itself after a stop signal


def stop_message(code: int, run_dir: RunDir, script: bool, resume: str = "auto") -> str:
    """The one line a job stopped by a signal ends with (exit ``code``: 130 / 143), saying only what the launcher
    knows: it writes no checkpoint for a ``script`` (a user's torchrun-style script); the built-in trainer's newest
    checkpoint in ``run_dir`` is read from its name, not assumed written at the stop (a stop during start-up comes
    before any). ``resume``: the job's ``train.resume``, which decides what running it again loads."""
    stopped = f"launcher: stopped by {signal.Signals(code - 128).name}"
    if script:
        return (
            f"{stopped}; the script's ranks were stopped (the launcher writes no checkpoint for a script=: whether "
            "it saved anything is up to the script)"
        )
    checkpoints = run_dir.checkpoints
    path = newest(checkpoints)  # (a file, or a sharded job's directory)
    if path is None:
        start = "the beginning" if resume in ("auto", "force", "never") else f"train.resume={resume}"
        return f"{stopped}; no checkpoint was written yet in {checkpoints}: running again starts from {start}"
    again = "" if resume in ("auto", "force") else " train.resume=auto"
    return (
        f"{stopped}; the newest checkpoint is {path} (step {step_of(path)}): run again with "
        f"hydra.run.dir={run_dir}{again} to continue from it"
    )


def print_stopped(code: int, job: JobConfig) -> None:
    """Print ``stop_message`` for ``job``, stopped by a signal (exit ``code``: 130 / 143)."""
    print(stop_message(code, job.run, job.script is not None, job.train.resume), file=sys.stderr)
