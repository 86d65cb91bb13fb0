"""``python -m launcher`` as a user types it, on real processes bounded by a deadline, so a hang fails fast.

One runner, ``run_job``: the launcher in its own session (its own process group, as a shell gives a foreground
job), each console line kept with its arrival, an optional ``watch`` checked while it runs; at the deadline it is
stopped as a user would (Ctrl-C to its process group), killed whole ``STOP_S`` later, and the test fails. Its
wrappers keep the shapes the tests read: ``run_launcher`` (``.returncode``, ``.stdout``, ``.stderr`` as
``subprocess.run`` gives them), ``run_timed`` (stdout and stderr as one console, each line timed) and
``run_watched`` (the failure report must begin within ``REPORT_S`` of a rank's error record, enforced while the job
runs). ``start_head`` starts one in the background instead."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from harness import REPO, heads

LAUNCHER = ("-m", "launcher")
# matplotlib's curves cost a CPU second a job: a test that looks at them asks (test_watch); the rest skip them
NO_PLOTS = "train.plots=false"
DEADLINE_S = 240  # a run still going then fails the test (each test may give its own)
STOP_S = 20  # how long a run stopped at its deadline gets to end what it started (then its process group is killed)
EOF_S = 10  # how long the console may stay open once the launcher exited (a process it left holding it)
POLL_S = 0.2  # the runner looks at the clock and the watch at least this often
TIMED_DEADLINE_S = 90  # run_timed's: a multi-node hang the watch did not end by then
REPORT_S = 10.0  # run_watched's: from a rank's error record to the first line of the launcher's failure report
REPORT_HEAD = r"launcher: rank \d+ \("  # the failure report's first line (at the start of a line)


def user_env(env: dict | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This environment as a user's shell has it (none of the launcher's or elastic's own variables, nor ``drop``'s
    prefixes), plus ``env``."""
    prefixes = ("LAUNCHER_", "TORCHELASTIC_", *drop)
    full = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    full.update(env or {})
    return full


def launcher_argv(run_dir: Path, *args: str, module: Sequence[str] = LAUNCHER) -> list[str]:
    """``python -m launcher [flags] hydra.run.dir=<run_dir> overrides...``: flags (``-m``, ...) first, as Hydra
    wants them before the overrides."""
    tail = list(args[args.index("--") :]) if "--" in args else []  # a script's own arguments: last, verbatim
    args = args[: len(args) - len(tail)]
    flags = [a for a in args if a.startswith("-")]
    rest = [a for a in args if not a.startswith("-")]
    if module[-1] == "launcher" and rest and not any(a.startswith("train.plots=") for a in rest):
        rest.append(NO_PLOTS)  # (a bare hydra.run.dir=X is the resume command the launcher prints: kept bare)
    return [sys.executable, *module, *flags, f"hydra.run.dir={run_dir}", *rest, *tail]


@dataclass(frozen=True)
class Line:
    at: float  # arrival, s after the start (monotonic)
    wall: float  # arrival on the wall clock (``time.time()``: comparable with the records' ``time_ns``)
    stream: str  # "stdout" or "stderr" ("stdout" for both when merged into one console)
    text: str  # with its newline


@dataclass
class Run:
    """A finished ``python -m launcher``: its exit code and every console line, in arrival order."""

    argv: list[str]
    lines: list[Line] = field(default_factory=list)
    code: int = -1
    wall_s: float = 0.0

    @property
    def returncode(self) -> int:
        return self.code

    @property
    def stdout(self) -> str:
        return "".join(line.text for line in self.lines if line.stream == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(line.text for line in self.lines if line.stream == "stderr")

    @property
    def console(self) -> str:
        """Both streams, line by line in the order they arrived (one stream when merged: exactly as written)."""
        return "".join(line.text for line in self.lines)

    def find(self, pattern: str, *, start: bool = False) -> Line | None:
        """The first line matching ``pattern`` (``start``: at its start, ``re.match``), or None."""
        match = re.match if start else re.search
        return next((line for line in self.lines if match(pattern, line.text)), None)

    def first(self, pattern: str) -> tuple[float, str]:
        """(arrival, line) of the first console line matching ``pattern``; fails showing the console's tail."""
        found = self.find(pattern)
        assert found is not None, f"no line matching {pattern!r} on the console:\n{self.console[-4000:]}"
        return found.at, found.text


def run_job(
    args: Sequence[str] = (),
    *,
    run_dir: Path,
    env: dict | None = None,
    drop: tuple[str, ...] = (),
    deadline_s: float = DEADLINE_S,
    stdout: Literal["pipe", "merge", "drop"] = "pipe",
    watch: Callable[[Run], None] | None = None,
    module: Sequence[str] = LAUNCHER,
) -> Run:
    """The one runner: ``python -m launcher hydra.run.dir=<run_dir> args...`` from the repository root, with this
    environment as a user's shell has it (``user_env(env, drop)``), in its own session. ``stdout``: kept apart
    from stderr (``pipe``), merged into one console (``merge``: the order as written), or dropped. Each line is
    kept with its arrival; ``watch(run)`` runs after each line and at least every ``POLL_S`` until the console
    closes (an assertion there fails the test, and the job is killed whole). At ``deadline_s`` the job is stopped
    as a user would (Ctrl-C to its process group), killed whole ``STOP_S`` later, and the test fails."""
    argv = launcher_argv(run_dir, *args, module=module)
    out = {"pipe": subprocess.PIPE, "merge": subprocess.PIPE, "drop": subprocess.DEVNULL}[stdout]
    err = subprocess.STDOUT if stdout == "merge" else subprocess.PIPE
    run = Run(argv)
    started = time.monotonic()
    proc = heads.popen(argv, cwd=REPO, env=user_env(env, drop), stdout=out, stderr=err)
    arrived: queue.SimpleQueue = queue.SimpleQueue()  # (monotonic, wall clock, stream, line); None at each end
    streams = [(name, pipe) for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)) if pipe is not None]
    readers = [threading.Thread(target=_read, args=(pipe, name, arrived), daemon=True) for name, pipe in streams]
    for reader in readers:
        reader.start()
    deadline, open_streams, exited_at, stopped = started + deadline_s, len(readers), None, False
    try:
        while time.monotonic() < deadline:
            if exited_at is not None and (not open_streams or time.monotonic() > exited_at + EOF_S):
                break
            with contextlib.suppress(queue.Empty):
                item = arrived.get(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                if item is None:
                    open_streams -= 1
                else:
                    at, wall, stream, text = item
                    run.lines.append(Line(at - started, wall, stream, text))
            if watch is not None:
                watch(run)
            if exited_at is None and proc.poll() is not None:
                exited_at = time.monotonic()
        if proc.poll() is None:  # the deadline: stopped as a user would (Ctrl-C: the launcher stops what it started)
            stopped = True
            _signal_group(proc, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_S)
    finally:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        for reader in readers:
            reader.join(timeout=max(0.0, (exited_at or time.monotonic()) + EOF_S - time.monotonic()))
    run.lines += [Line(at - started, wall, s, text) for at, wall, s, text in _drain(arrived)]
    run.code, run.wall_s = proc.returncode, time.monotonic() - started
    assert not stopped, f"still running after {deadline_s:.0f} s (stopped):\n{run.console[-4000:]}"
    return run


def _read(pipe, stream: str, arrived: queue.SimpleQueue) -> None:
    for line in pipe:
        arrived.put((time.monotonic(), time.time(), stream, line))
    arrived.put(None)


def _drain(arrived: queue.SimpleQueue) -> list[tuple[float, float, str, str]]:
    items = []
    with contextlib.suppress(queue.Empty):
        while True:
            if (item := arrived.get_nowait()) is not None:
                items.append(item)
    return items


def _signal_group(proc: heads.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def run_launcher(
    *overrides: str,
    run_dir: Path,
    timeout: float = DEADLINE_S,
    env: dict | None = None,
    module: tuple[str, ...] = LAUNCHER,
) -> Run:
    """``python -m launcher hydra.run.dir=<run_dir> overrides...`` as a user would type it; ``.returncode``,
    ``.stdout`` and ``.stderr`` as ``subprocess.run(..., capture_output=True, text=True)`` gives them."""
    return run_job(overrides, run_dir=run_dir, env=env, deadline_s=timeout, module=module)


def run_timed(args: list[str], run_dir: Path, env: dict[str, str], deadline_s: float = TIMED_DEADLINE_S) -> Run:
    """``python -m launcher`` as a user types it (none of the hang script's ``HANG_*`` but ``env``'s); its console
    (stdout and stderr, as written) line by line, each with its arrival (``run.first(pattern)``)."""
    return run_job(args, run_dir=run_dir, env=env, drop=("HANG_",), deadline_s=deadline_s, stdout="merge")


def first_error_record(run_dir: Path) -> float | None:
    """When (wall clock) the first rank recorded an error of its own (kind ``error``), or None."""
    times = []
    for path in run_dir.glob("failures/*/attempt-*/rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written (atomically: it appears whole, but a rename can race the glob)
        if record.get("kind") == "error":
            times.append(record["time_ns"] / 1e9)
    return min(times, default=None)


def report_within(run_dir: Path, seconds: float = REPORT_S) -> Callable[[Run], None]:
    """A ``watch``: once a rank has recorded its error, the failure report must begin on stderr within ``seconds``
    (checked while the job runs, not when a line happens to arrive)."""
    failed_at: float | None = None
    seen, reported = 0, False

    def watch(run: Run) -> None:
        nonlocal failed_at, seen, reported
        reported = reported or any(re.match(REPORT_HEAD, line.text) for line in run.lines[seen:])
        seen = len(run.lines)
        if not reported:
            failed_at = failed_at or first_error_record(run_dir)
            late = failed_at is not None and time.time() - failed_at > seconds
            assert not late, f"no failure report {seconds:.0f} s after a rank's error:\n{run.stderr[-3000:]}"

    return watch


def run_watched(
    args: list[str], run_dir: Path, env: dict[str, str], timeout: float = DEADLINE_S
) -> tuple[int, str, float]:
    """Run ``python -m launcher`` (stdout dropped) and note when (wall clock) its failure report began on stderr.
    Enforced while it runs: once a rank has recorded its error, the report must begin within REPORT_S (else the
    launcher and everything it started are killed and the test fails), and the whole job must end within
    ``timeout``. (exit code, stderr, when the report began or 0.0)."""
    run = run_job(args, run_dir=run_dir, env=env, deadline_s=timeout, stdout="drop", watch=report_within(run_dir))
    head = run.find(REPORT_HEAD, start=True)
    return run.code, run.stderr, head.wall if head is not None else 0.0


def start_head(run_dir: Path, *overrides: str, log: Path, env: dict | None = None) -> heads.Process:
    """``python -m launcher`` in the background, in its own process group (as a shell gives a foreground job),
    stderr to ``log``."""
    with open(log, "w") as stderr:
        argv = launcher_argv(run_dir, *overrides)
        return heads.popen(argv, cwd=REPO, env=user_env(env), stdout=subprocess.DEVNULL, stderr=stderr)


def wait_first_checkpoint(head: heads.Process, run_dir: Path, log: Path, timeout: float = 120) -> list[Path]:
    """Until the job wrote a checkpoint (the head must still run); the checkpoints then."""
    deadline = time.monotonic() + timeout
    while not list(run_dir.glob("checkpoints/step-*.pt")):
        assert head.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return sorted(run_dir.glob("checkpoints/step-*.pt"))
