"""The progress watch across nodes: in every multi-node mode (``+cluster=sim``, ``+cluster=ssh``, Slurm) a job whose
last rank, on the second node, is stuck (a ``script=`` blocked in its own code, or the trainer's ``stall`` fault).
Each test asserts what the user sees: the first ``hang:`` line on the console names the culprit (with its host)
before the ranks that wait for it, with a frame of its live stack; the launcher's failure report leads with the
culprit ``hung:``; ``RUN_DIR/hangs/*/report.json`` names it; and the whole run ends within a bound of
``comm.timeout_s``. On this host: tests/test_hangs.py; on Slurm: tests/test_slurm.py (its cluster)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from test_ssh import HOSTS, machines, ssh_args  # noqa: F401 (fixtures)
from test_ssh import pytestmark as needs_ssh_machines

from helpers import REPO, launcher_argv, user_env

SCRIPT = "script=tests/scripts/hang_script.py"
WARN_S, TIMEOUT_S = 4, 10  # comm.hang_warn_s, comm.timeout_s: the report at ~4 s of the hang, the end at ~10 s
WATCH = (f"comm.hang_warn_s={WARN_S}", f"comm.timeout_s={TIMEOUT_S}")
BOUND_S = 75  # the whole run: start-up, the hang up to comm.timeout_s, the end and the report (typical 25 s)
DEADLINE_S = 90  # a run still going then (the watch did not end it) is stopped, and the test fails
STOP_S = 20  # how long a stopped run gets to end what it started (then its process group is killed)
STUCK = {"HANG_CASE": "stuck"}
# a frame and its source line (over ssh each console line starts with "[host] ")
STUCK_FRAME = r'hang_script\.py", line \d+, in stuck_in_user_code\n[^\n]*  time\.sleep\(1\)'
STALL_FRAME = r'faults\.py", line \d+, in fire\n[^\n]*  threading\.Event\(\)\.wait\(\)'


@dataclass
class Run:
    code: int
    lines: list[tuple[float, str]]  # the console (stdout and stderr), each line with its arrival, s after the start
    wall_s: float

    @property
    def console(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str) -> tuple[float, str]:
        """(arrival, line) of the first console line matching ``pattern``; fails showing the console's tail."""
        found = next(((at, line) for at, line in self.lines if re.search(pattern, line)), None)
        assert found is not None, f"no line matching {pattern!r} on the console:\n{self.console[-4000:]}"
        return found


def run_timed(args: list[str], run_dir: Path, env: dict[str, str], deadline_s: float = DEADLINE_S) -> Run:
    """``python -m launcher`` as a user types it; each console line is noted with its arrival. Killed whole (its
    own process group) at ``deadline_s``, which fails the test."""
    full_env = user_env(env, drop=("HANG_",))
    started = time.monotonic()
    proc = subprocess.Popen(
        launcher_argv(run_dir, *args),
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = None
    try:
        code = proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:  # stopped as a user would (Ctrl-C: the launcher stops what it started)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_S)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
    run = Run(code if code is not None else -1, lines, time.monotonic() - started)
    assert code is not None, f"still running after {deadline_s} s (stopped):\n{run.console[-4000:]}"
    return run


def assert_hang_named(
    run: Run, run_dir: Path, culprit: int, host: str, waiting: list[int], who: str, frame: str
) -> None:
    """The job failed; the console names the hang at comm.hang_warn_s, ``culprit`` (on ``host``) first, with
    ``frame`` in its live stack; the failure report leads with it, ``hung:``, then lists the ``waiting`` ranks
    (``who``: a regex of what both say between "rank N (" and ") on HOST"); report.json says the same; in time."""
    console = run.console
    print(f"exit {run.code} after {run.wall_s:.1f} s")
    assert run.code != 0, console[-4000:]
    # the live report: the culprit first, named as the failure report names it, then the ranks waiting for it
    warned_at, line = run.first(r"\bhang: ")
    others = f"rank {waiting[0]} waits" if len(waiting) == 1 else f"ranks {', '.join(map(str, waiting))} wait"
    named = rf"hang: rank {culprit} \({who}\) on {re.escape(host)} has not entered collective #\d+ "
    assert re.search(rf"{named}of the default group for \d+ s; {others} in it \(", line), line
    assert line.index(f"rank {culprit} ") < line.index(others), line
    # the failure report: the culprit first, "hung:"; then the ranks that waited for it
    reported_at, head = run.first(r"^launcher: rank \d+ \(")
    print(f"hang named after {warned_at:.1f} s, failure report after {reported_at:.1f} s")
    assert re.match(rf"launcher: rank {culprit} \({who}\) on {re.escape(host)} hung: has not entered", head), head
    # named live, at comm.hang_warn_s: well before the end at comm.timeout_s (on Slurm too, through rank 0's log)
    assert reported_at - warned_at > (TIMEOUT_S - WARN_S) / 2, (warned_at, reported_at)
    live = console[console.index(line) : console.index(head)]
    assert f"  stack of rank {culprit} (live, every thread):" in live and re.search(frame, live), live[-4000:]
    for wrapper in ("submitit/core", "hydra/", "runpy", "launcher/cli.py"):  # what only carries a rank to its work
        assert wrapper not in live.split("  stack of rank")[1], live[-4000:]
    after = console[console.index(head) :]
    for rank in waiting:
        peer = rf"^launcher: failed too: rank {rank} on .*after a peer failed \(waited \d+ s in collective #\d+ for "
        assert re.search(rf"{peer}rank {culprit}\)", after, re.M), after[-4000:]
    # the files: one report, the culprit first, with its host and its stack
    (report_path,) = run_dir.glob("hangs/*/report.json")
    report = json.loads(report_path.read_text())
    assert report["kind"] == "hang" and report["waiting"] == waiting, report
    assert (report["culprits"][0]["rank"], report["culprits"][0]["host"]) == (culprit, host), report["culprits"]
    assert re.search(frame, report["culprits"][0]["stack"]), report["culprits"][0]["stack"]
    # ended by the watch at comm.timeout_s (a script's own process group would wait 30 minutes): the report
    # follows the hang's naming by about comm.timeout_s - comm.hang_warn_s (6 s; the bound is 3x); the whole run,
    # start-up included, typically 25 s (on a loaded box up to 45 s: the bound is 3x the typical)
    assert reported_at - warned_at < 3 * (TIMEOUT_S - WARN_S), (warned_at, reported_at)
    assert run.wall_s < BOUND_S, f"{run.wall_s:.0f} s (hang named after {warned_at:.0f} s, report {reported_at:.0f} s)"


# ------------------------------------------------------------------------------------------------ sim
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")


def test_sim_script_stuck_on_the_second_node(tmp_path):
    run = run_timed([*SIM, SCRIPT, *WATCH], tmp_path, {**STUCK, "HANG_RANK": "1"})
    assert_hang_named(run, tmp_path, 1, socket.gethostname(), [0], r"node 1, pid \d+", STUCK_FRAME)


def test_sim_trainer_stalled_on_the_second_node(tmp_path):
    args = [*SIM, *WATCH, "train.max_steps=30", "train.checkpoint_every_steps=0"]
    run = run_timed(args, tmp_path, {"LAUNCHER_FAULT": "step=5,rank=1,stall"})
    assert_hang_named(run, tmp_path, 1, socket.gethostname(), [0], r"node 1, pid \d+", STALL_FRAME)


# ------------------------------------------------------------------------------------------------ ssh
@needs_ssh_machines
def test_ssh_script_stuck_on_the_second_machine(ssh_args, tmp_path):  # noqa: F811 (the imported fixture)
    """2 machines x 2 ranks, rank 3 stuck; HANG_* reach the machines through cluster.env."""
    args = [*ssh_args, "cluster.procs_per_node=2", "cluster.env=[HANG_CASE,HANG_RANK]", SCRIPT, *WATCH]
    run = run_timed(args, tmp_path, {**STUCK, "HANG_RANK": "3"})
    assert_hang_named(run, tmp_path, 3, HOSTS[1], [0, 1, 2], r"node 1, pid \d+", STUCK_FRAME)
    assert run.first(r"\bhang: ")[1].startswith(f"[{HOSTS[0]}] [launcher] hang: "), "not rank 0's console"


# Slurm (the stuck last rank on the second node): tests/test_slurm.py, on its session's cluster.
