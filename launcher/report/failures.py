"""The one report a failed job gives, in every mode: the root cause first, then the ranks that failed too.

Why records, and not what the launcher sees: each node's agent knows only its own workers and their exit codes,
not which error came first (with multiprocessing workers elastic even reported one worker per node, the first
in poll order: when two ranks exited within one 0.1 s monitor tick it named the lower local rank, usually a peer
that failed a moment after the real cause; our workers are now commands, as under torchrun). So:
- every rank writes a failure record into the run dir (on a shared file system in every multi-node mode) the
  moment its error is first caught, before it tears its process group down (which is what makes its peers
  fail); from then on it ignores the launcher's stop signals (it is ending anyway, and a kill mid-write would
  leave a truncated record, or a truncated elastic error file that crashes torch's agent);
- an agent adds a record for each of its ranks that ended without one (a signal, ``os._exit``);
- one reporter reads them all and chooses.

The choice does not rest on the clocks of different machines: records are ranked by kind
(``launcher.base.errors.RANKED``), then by time within a kind (several ranks failing on their own at once: any of
them is a true cause):

  error    the rank's own exception: what we look for
  hang     named by the progress watch at comm.timeout_s: every other rank waited for this one (launcher.watch)
  died     killed by a signal other than the launcher's stop signals, or exited without a record (OOM killer,
           segfault, ``os._exit``)
  lost     healing in place gave up (``HealStop``): too few machines left, a round that never formed
  peer     a consequence of another rank failing: connection closed or reset by a peer, a collective or the
           store timing out, an NCCL abort, peers that never joined, a machine lost
  stopped  ended by the launcher (SIGTERM / SIGINT) after another rank failed

A record's kind comes from the error's type first (``kind_of``: a launcher error carries its own); only torch's own
messages are read as text, in one table (``launcher.base.errors.TORCH_SAYS``). A rank that left a job going on
without it, or a Slurm task leaving for its job's requeue, writes none (``ends_cleanly``).

Layout: ``RUN_DIR/failures/<launch id>/attempt-<n>/rank-<k>.json`` (launch id: the elastic run id or the Slurm
job id; n: the 0-based attempt, restarts or requeues so far), so a restarted or resumed job never reads an
earlier attempt's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, TextIO

from launcher.base.env import DistEnv
from launcher.base.errors import CALLBACK_ERROR, RANKED, Kind, LauncherError, ends_cleanly, kind_of
from launcher.base.files import write_json_atomic
from launcher.base.run_dir import RunDir, failure_record_file, failure_record_files
from launcher.report.stops import STOP_CODES, STOP_SIGNALS
from launcher.report.tracebacks import format_traceback, log_tail


@dataclass(frozen=True)
class Failure:
    """How one rank failed."""

    rank: int
    kind: Kind  # one of RANKED (a record's text: the member's value, read back as the member)
    summary: str  # one line: "RuntimeError: boom", "died with signal 9 (SIGKILL)"
    host: str = "?"
    node: int = 0
    nodes: int = 1  # the job's node count: a report names nodes when there are several
    pid: int = 0
    task: str = ""  # the scheduler's name for the process, e.g. "task 2 of Slurm job 17"
    traceback: str = ""
    time_ns: int = 0
    exitcode: Optional[int] = None  # ended without a record of its own: its exit code (negative: the signal)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))  # read back from a record: its text (ValueError: unknown)

    def who(self, with_node: bool = False) -> str:
        ids = ", ".join(
            filter(None, [self.task, f"node {self.node}" if with_node else "", f"pid {self.pid}" if self.pid else ""])
        )
        return f"rank {self.rank}" + (f" ({ids})" if ids else "") + f" on {self.host}"

    def ended(self) -> str:
        """How it ended, in the words the report starts with: the signal or exit, ``hung: ...``, else ``failed:``
        (the error follows)."""
        said = {Kind.died: self.summary, Kind.stopped: self.summary, Kind.hang: f"hung: {self.summary}"}
        return said.get(self.kind, "failed:")


def summarize(exc: BaseException) -> str:
    """One line: the error's type and the first line of its message (a message's later lines, torch's ``At:`` frames
    and the like, are in the traceback), the error a failed future's callback raised rather than torch's wrapper;
    a launcher error by its class's name alone (its module says nothing to the reader of a report)."""
    lines = "".join(traceback.format_exception_only(exc)).strip().splitlines()
    name = type(exc).__name__
    line = next((x for x in lines if x.split(":", 1)[0].endswith(name)), lines[-1] if lines else name)
    if isinstance(exc, LauncherError) and line.startswith(f"{type(exc).__module__}."):
        line = line[len(type(exc).__module__) + 1 :]
    return line.partition(CALLBACK_ERROR)[2] or line


def _write(path: Path, failure: Failure) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, asdict(failure))


class FailureLog:
    """This rank's failure record: the first failure caught is written, once. The launcher's own single process (no
    agent, no peers to confuse with) writes nothing: it prints its traceback itself. ``on_failure``: called first
    (the rank's stop handling stops listening to stop signals). ``stopped``: true once the rank ends on a stop
    (a script's rank that got a stop signal: an error then, a peer gone first, is no failure; it writes nothing)."""

    def __init__(
        self,
        run_dir: RunDir,
        env: DistEnv,
        task: str = "",
        on_failure: Callable[[], None] | None = None,
        stopped: Callable[[], bool] = lambda: False,
    ) -> None:
        self.env, self.task, self.on_failure, self.stopped = env, task, on_failure, stopped
        self.path = run_dir.failure_record(env.launch_id, env.attempt, env.rank)
        self.written = False

    def record(self, exc: BaseException) -> None:
        if self.written or (self.env.world_size == 1 and not self.env.launch_id):  # run in the launcher itself
            return
        if self.stopped():  # the rank's end is the stop's
            return
        if ends_cleanly(exc):  # out of a job that goes on, or leaving for a requeue: no failure
            return
        self.written = True
        if self.on_failure is not None:
            self.on_failure()
        if self.path.exists():  # the watch named this rank as the hang's culprit: that record says more
            return
        _write(
            self.path,
            Failure(
                rank=self.env.rank,
                kind=kind_of(exc),
                summary=summarize(exc),
                host=self.env.hostname or socket.gethostname(),
                node=self.env.node_rank,
                nodes=self.env.num_nodes,
                pid=os.getpid(),
                task=self.task,
                traceback=format_traceback(exc),
                time_ns=time.time_ns(),
            ),
        )

    def others_failed(self) -> bool:
        """Another rank of this attempt has recorded its failure (the job is ending)."""
        return any(path != self.path for path in failure_record_files(self.path.parent))

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Record an exception leaving the block, then let it go on."""
        try:
            yield
        except BaseException as exc:
            self.record(exc)
            raise


def exit_failure(
    rank: int, pid: int, exitcode: int, host: str, node: int = 0, nodes: int = 1, task: str = ""
) -> Failure:
    """What a rank that ended without a record of its own died of, from its exit code (negative: a signal)."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        kind = Kind.stopped if -exitcode in STOP_SIGNALS else Kind.died
        summary = f"died with signal {-exitcode} ({name})"
    else:
        kind = Kind.stopped if exitcode in STOP_CODES else Kind.died
        summary = f"exited with code {exitcode}"
    return Failure(
        rank=rank,
        kind=kind,
        summary=summary,
        host=host,
        node=node,
        nodes=nodes,
        pid=pid,
        task=task,
        time_ns=time.time_ns(),
        exitcode=exitcode,
    )


def record_exits(directory: Path, exits: Iterable[Failure]) -> None:
    """An agent's view of its ranks that ended without writing a record (their records stay as they are)."""
    for failure in exits:
        path = failure_record_file(directory, failure.rank)
        if not path.exists():
            _write(path, failure)


def load_newest(run_dir: RunDir, launch_id: str) -> list[Failure]:
    """The records of the newest attempt of ``launch_id``."""
    attempts = run_dir.failure_attempts(launch_id)
    return _read(attempts[-1]) if attempts else []


def load_attempt(run_dir: RunDir, launch_id: str, attempt: int) -> list[Failure]:
    """The records of one attempt of ``launch_id``."""
    return _read(run_dir.failure_attempt(launch_id, attempt))


def _read(directory: Path) -> list[Failure]:
    failures = []
    for path in failure_record_files(directory):
        try:
            failures.append(Failure(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # unreadable: the other records still tell the story
    return failures


def hang_ended(run_dir: RunDir, launch_id: str, attempt: int) -> bool:
    """Whether the progress watch ended this attempt for a hang (it wrote a culprit's record)."""
    return any(f.kind is Kind.hang for f in load_attempt(run_dir, launch_id, attempt))


def ranked(failures: Iterable[Failure]) -> list[Failure]:
    """Root cause first: by kind (RANKED), then by time within the kind, then by rank."""
    return sorted(
        failures, key=lambda f: (RANKED.index(f.kind) if f.kind in RANKED else len(RANKED), f.time_ns, f.rank)
    )


HOW = {Kind.peer: "after a peer failed", Kind.stopped: "stopped by the launcher", Kind.lost: "healing stopped"}


def format_report(failures: list[Failure], run_dir: RunDir, limit: int = 8) -> str:
    cause, *others = ranked(failures)
    nodes = max(f.nodes for f in failures) > 1  # say which node: hosts may share a name (simulated nodes)
    what = cause.ended()
    lines = [f"launcher: {cause.who(nodes)} {what}"]
    lines.append(cause.traceback or (cause.summary if what == "failed:" else "") or log_tail(run_dir, cause.rank))
    lines.append(f"launcher: log of rank {cause.rank}: {run_dir.rank_log(cause.rank)}")
    for other in others[:limit]:
        how = HOW.get(other.kind, other.kind.value)
        detail = other.summary if len(other.summary) <= 160 else other.summary[:157] + "..."
        where = f"node {other.node}, {other.host}" if nodes else other.host
        lines.append(f"launcher: failed too: rank {other.rank} on {where}, {how} ({detail})")
    if len(others) > limit:
        lines.append(f"launcher: failed too: {len(others) - limit} more rank(s) (see {run_dir.failures})")
    return "\n".join(line.rstrip() for line in lines if line)


def print_report(run_dir: RunDir, launch_id: str, known: Iterable[Failure] = (), file: Optional[TextIO] = None) -> bool:
    """Print the job's failure report from the records (plus ``known`` failures of ranks without one).
    Returns False when there is nothing to report."""
    failures = {f.rank: f for f in known}
    failures.update({f.rank: f for f in load_newest(run_dir, launch_id)})  # a rank's own record says more
    if not failures:
        return False
    print(format_report(list(failures.values()), run_dir), file=file or sys.stderr, flush=True)
    return True
