"""Stopping a job on a signal, in words every mode shares: which signals stop a job (``STOP_SIGNALS``: sent to its
head alone, or to a rank; torchrun's too), the exit codes of a rank or head that stopped on one (``STOP_CODES``:
128 + the signal), how each rank ended after it (``RankEnd``: recorded in the run dir by its agent, or by a script's
rank itself) and the one line a stopped job ends with (``stop_message``), whichever mode ran it. How a head passes a
stop on to its nodes is the launch mode's (``launch/nodes/attempts.py``), how an agent gives its ranks their grace
``launch/nodes/elastic.py``'s; how the ranks agree on a step to stop at is the trainer's (``train/stop.py``). No
torch here."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Optional

from launcher.base.checkpoint_names import newest, step_of
from launcher.base.files import write_json_atomic
from launcher.base.run_dir import RunDir, stop_end_file, stop_end_files
from launcher.config import JobConfig

# what stops a job, sent to its head alone (a user's kill, a CI runner, a scheduler; Ctrl-C reaches the group) or
# to a rank (the trainer's ranks stop at an agreed step with a checkpoint; a script's get the signal itself)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_CODES = tuple(128 + s for s in STOP_SIGNALS)  # a rank or a head that stopped itself after a stop signal


@dataclass(frozen=True)
class RankEnd:
    """How rank ``rank`` (of node ``node``, on ``host``) ended after a stop signal: its exit ``code`` (negative: the
    signal that ended it, as ``subprocess`` says), or ``killed``: why the launcher killed it."""

    rank: int
    host: str
    code: Optional[int]
    node: int = 0
    killed: str = ""  # e.g. "after 30 s (cluster.stop_grace_s)", "at once (a second SIGINT)"

    def outcome(self) -> str:
        if self.killed:
            return f"killed {self.killed}"
        if self.code is None:
            return "still running when the launcher ended"
        if self.code < 0:
            return f"ended by {_name(-self.code)}"
        return f"exited {self.code}"


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def record_ends(run_dir: RunDir, launch_id: str, attempt: int, ends: Iterable[RankEnd]) -> None:
    """Each rank's end into the attempt's stop records (a later record of a rank replaces its earlier one: its
    agent's, written once the rank has ended, replaces the rank's own)."""
    folder = run_dir.stop_ends(launch_id, attempt)
    for end in ends:
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(stop_end_file(folder, end.rank), asdict(end))


def load_ends(run_dir: RunDir, launch_id: str) -> list[RankEnd]:
    """The stop records of ``launch_id``'s newest attempt that has any, by rank."""
    folders = run_dir.stop_end_attempts(launch_id)
    if not folders:
        return []
    ends = []
    for path in stop_end_files(folders[-1]):
        try:
            ends.append(RankEnd(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # (being replaced, or not ours)
    return sorted(ends, key=lambda e: e.rank)


def said_ends(ends: Sequence[RankEnd]) -> str:
    """``ranks 0, 1 on a exited 0; rank 2 on b killed after 30 s (cluster.stop_grace_s)``: ranks of one host that
    ended alike together, in rank order."""
    groups: list[tuple[str, str, list[int]]] = []
    for end in sorted(ends, key=lambda e: e.rank):
        if groups and groups[-1][:2] == (end.host, end.outcome()):
            groups[-1][2].append(end.rank)
        else:
            groups.append((end.host, end.outcome(), [end.rank]))
    return "; ".join(f"{ranks_on(ranks, host)} {outcome}" for host, outcome, ranks in groups)


def ranks_on(ranks: Sequence[int], host: str) -> str:
    """``rank 3 on h`` / ``ranks 0, 1 on h``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} on {host}"


def said_killed(
    ranks: Sequence[int], host: str, signum: int, grace_s: float, again: Optional[int], waited_s: float
) -> tuple[str, str]:
    """The line saying ``ranks`` on ``host`` were killed after the stop ``signum`` (``again``: the second stop that
    cut their grace short, ``waited_s`` into it; None: ``grace_s`` ran out), and why, for their ``RankEnd``."""
    if again is not None:
        why = f"at once (a second stop signal, {_name(again)})"
        line = f"a second stop signal ({_name(again)}) {waited_s:.1f} s into the ranks' grace: "
        return f"launcher: {line}{ranks_on(ranks, host)} killed at once", why
    why = f"after {grace_s:g} s (cluster.stop_grace_s)"
    line = f"did not exit within {grace_s:g} s of {_name(signum)} (cluster.stop_grace_s): killed"
    return f"launcher: {ranks_on(ranks, host)} {line}", why


def stop_message(code: int, run_dir: RunDir, script: bool, resume: str = "auto", ends: Sequence[RankEnd] = ()) -> str:
    """The one line a job stopped by a signal ends with (exit ``code``: 130 / 143 / 129), saying only what the
    launcher knows. A ``script`` (a user's torchrun-style script) got the signal itself and its grace: how each of
    its ranks ended (``ends``; the launcher writes no checkpoint for it). The built-in trainer's newest checkpoint in
    ``run_dir`` is read from its name, not assumed written at the stop (a stop during start-up comes before any).
    ``resume``: the job's ``train.resume``, which decides what running it again loads."""
    stopped = f"launcher: stopped by {_name(code - 128)}"
    if script:
        said = said_ends(ends) or "none left word (a rank ended by the signal itself or killed leaves none)"
        return (
            f"{stopped}; how the script's ranks ended: {said} (the launcher writes no checkpoint for a script=: what "
            "it saves on a stop is its own handler's)"
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


def print_stopped(
    code: int, job: JobConfig, launch_id: Optional[str] = None, ends: Optional[Sequence[RankEnd]] = None
) -> None:
    """Print ``stop_message`` for ``job``, stopped by a signal (exit ``code``: 130 / 143 / 129): a script's ranks'
    ends as given, or as recorded for ``launch_id``."""
    if ends is None:
        ends = load_ends(job.run, launch_id) if launch_id is not None and job.script is not None else []
    print(stop_message(code, job.run, job.script is not None, job.train.resume, ends), file=sys.stderr)
