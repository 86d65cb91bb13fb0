"""A ``script=`` job's stop, as torchrun's (issue 58, item 1; docs/running.md, "Stopping a job"): its ranks get the
stop signal itself and ``cluster.stop_grace_s`` to exit. A script that ignores it is killed when the grace runs out,
the ranks named; a second Ctrl-C during the grace ends them at once (the local agent's own, and the sim head's
passed on); a script without a handler of its own ends as Python ends it (Ctrl-C: ``KeyboardInterrupt``, exit 130;
SIGTERM: the default action) and that is a stop, not a failure; a script's atexit handlers run on a normal end, last
in first out, before the launcher's own end of the process. (Every mode x signal with a script that handles it: the
signal matrix, tests/harness/stops.py.) The jobs run side by side (a module fixture), each test checks its own."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import TESTS, path_override
from harness.run import launcher_argv
from harness.stops import LOOP_SCRIPT, READY_S, marks, popen_logged, processes_of, script_ends

STUBBORN = TESTS / "scripts" / "stubborn_script.py"
ATEXIT = TESTS / "scripts" / "atexit_script.py"
END_S = 60.0  # from the last signal (or the start) to the head's end: far beyond every bound checked
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")
LOCAL = ("cluster.procs_per_node=2",)
HOST = socket.gethostname()


@dataclass(frozen=True)
class Case:
    """One job: its overrides (``{marks}``: the folder its script writes in), the signals sent to its head one after
    the other once every rank runs (a second one once every rank noted the first: ``got-<rank>``; SIGTERM to the
    head alone, the others to its group, as a terminal sends them), its ranks."""

    args: tuple[str, ...]
    signals: tuple[signal.Signals, ...] = ()
    ranks: int = 2


@dataclass
class Ended:
    """How a case's job ended (``failed``: why it could not be driven to its end: each test says so for its own)."""

    code: int | None
    after_s: float  # from the last signal sent (or the start) to the head's end
    log: str
    marks: Path
    run_dir: Path
    left: list[str] = field(default_factory=list)
    failed: str = ""


def of(ended: dict[str, Ended], name: str) -> Ended:
    """Case ``name``'s end, once it was driven to it."""
    out = ended[name]
    assert not out.failed, f"{name}: {out.failed}\n{out.log[-3000:]}"
    return out


def script(path: Path) -> tuple[str, ...]:
    return (path_override("script", path), "script_args=[{marks}]")


CASES = {
    "ignored-TERM-local": Case((*LOCAL, *script(STUBBORN), "cluster.stop_grace_s=2"), (signal.SIGTERM,)),
    "second-INT-local": Case((*LOCAL, *script(STUBBORN)), (signal.SIGINT, signal.SIGINT)),
    "second-INT-sim": Case((*SIM, *script(STUBBORN)), (signal.SIGINT, signal.SIGINT)),
    "unhandled-INT-local": Case((*LOCAL, *script(LOOP_SCRIPT)), (signal.SIGINT,)),
    "unhandled-TERM-local": Case((*LOCAL, *script(LOOP_SCRIPT)), (signal.SIGTERM,)),
    "atexit-local": Case((*LOCAL, *script(ATEXIT))),
    "atexit-one-process": Case(("cluster.procs_per_node=1", *script(ATEXIT)), ranks=1),
}


def wait_for(files: list[Path], proc: subprocess.Popen) -> str:
    """ "" once every one of ``files`` exists; else why not (the job ended, or it took ``READY_S``)."""
    deadline = time.monotonic() + READY_S
    while not all(f.exists() for f in files):
        if proc.poll() is not None or time.monotonic() > deadline:
            return f"{[f.name for f in files if not f.exists()]} not there (exit code {proc.poll()})"
        time.sleep(0.1)
    return ""


def drive(name: str, case: Case, base: Path) -> Ended:
    run_dir, log = base / name / "run", base / name / "head.log"
    folder = marks(run_dir)
    folder.mkdir(parents=True)
    args = [a.replace("{marks}", str(folder)) for a in case.args]
    proc = popen_logged(launcher_argv(run_dir, *args), log)
    try:
        since, failed = time.monotonic(), ""
        for n, signum in enumerate(case.signals):
            seen = "got" if n else "running"  # (the first once every rank runs; the next once each noted one)
            if failed := wait_for([folder / f"{seen}-{r}" for r in range(case.ranks)], proc):
                break
            (os.killpg if signum != signal.SIGTERM else os.kill)(proc.pid, signum)
            since = time.monotonic()
        try:
            code = proc.wait(timeout=END_S)
        except subprocess.TimeoutExpired:
            code, failed = None, failed or f"still running {END_S:.0f} s after the last signal"
        return Ended(code, time.monotonic() - since, log.read_text(), folder, run_dir, processes_of(run_dir), failed)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for line in processes_of(run_dir):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


@pytest.fixture(scope="module")
def ended(request, tmp_path_factory) -> dict[str, Ended]:
    """The cases of the tests this session runs (``-k``, a node id: only those), 3 side by side."""
    items = [i for i in request.session.items if i.module is request.module and hasattr(i, "callspec")]
    chosen = dict.fromkeys(i.callspec.params["name"] for i in items if "name" in i.callspec.params)
    base = tmp_path_factory.mktemp("grace")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(drive, name, CASES[name], base) for name in chosen}
        return {name: future.result() for name, future in futures.items()}


def got(out: Ended, rank: int) -> list[str]:
    path = out.marks / f"got-{rank}"
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("name", ["ignored-TERM-local"])
def test_a_script_that_ignores_the_stop_is_killed_after_its_grace_and_named(ended, name):
    out = of(ended, name)
    assert out.code == 143, out.log
    assert got(out, 0) == got(out, 1) == ["SIGTERM"], out.log  # each rank got the signal itself, once
    assert 2.0 <= out.after_s < 12.0, f"ended {out.after_s:.1f} s after SIGTERM with cluster.stop_grace_s=2\n{out.log}"
    said = f"launcher: ranks 0, 1 on {HOST} did not exit within 2 s of SIGTERM (cluster.stop_grace_s): killed"
    assert said in out.log, out.log
    assert script_ends(out.log) == dict.fromkeys((0, 1), "killed after 2 s (cluster.stop_grace_s)"), out.log
    assert not out.left, out.left


@pytest.mark.parametrize("name", ["second-INT-local", "second-INT-sim"])
def test_a_second_ctrl_c_during_the_grace_ends_the_ranks_at_once(ended, name):
    """The grace is 30 s; the second Ctrl-C ends the job in seconds, and each end says why."""
    out = of(ended, name)
    assert out.code == 130, out.log
    assert got(out, 0) == got(out, 1) == ["SIGINT"], out.log
    assert out.after_s < 15.0, f"ended {out.after_s:.1f} s after the second SIGINT (the grace: 30 s)\n{out.log}"
    if name.endswith("sim"):  # the head passes it on to every node, whose agent kills its ranks
        assert "launcher: a second stop signal (SIGINT): ending the job on every node at once" in out.log, out.log
        for rank in (0, 1):  # each node names the signal sent, not ABORT's SIGTERM (issue 60, item 6: edge 7)
            said = re.escape("launcher: a second stop signal (SIGINT) ") + r"[\d.]+"
            assert re.search(said + re.escape(f" s into the ranks' grace: rank {rank} on {HOST} killed"), out.log)
        assert set(script_ends(out.log).values()) == {"killed at once (a second stop signal, SIGINT)"}, out.log
    else:
        assert f"into the ranks' grace: ranks 0, 1 on {HOST} killed at once" in out.log, out.log
    assert all(end.startswith("killed at once") for end in script_ends(out.log).values()), out.log
    assert sorted(script_ends(out.log)) == [0, 1], out.log
    assert not out.left, out.left


@pytest.mark.parametrize(
    "name, code, end", [("unhandled-INT-local", 130, "exited 130"), ("unhandled-TERM-local", 143, "ended by SIGTERM")]
)
def test_a_script_without_a_handler_ends_as_python_ends_it_and_that_is_a_stop(ended, name, code, end):
    """Ctrl-C: ``KeyboardInterrupt`` in every rank, exit 130; SIGTERM: its default action. No failure record, no
    failure report, no traceback on the console: the job was stopped."""
    out = of(ended, name)
    assert out.code == code, out.log
    assert script_ends(out.log) == dict.fromkeys((0, 1), end), out.log
    assert not (out.run_dir / "failures").exists(), sorted((out.run_dir / "failures").rglob("*"))
    assert "failed" not in out.log and "Traceback" not in out.log, out.log
    assert not out.left, out.left


@pytest.mark.parametrize("name", ["atexit-local", "atexit-one-process"])
def test_a_scripts_atexit_handlers_run_on_a_normal_end_last_in_first_out(ended, name):
    out = of(ended, name)
    assert out.code == 0, out.log
    for rank in range(CASES[name].ranks):
        path = out.marks / f"atexit-{rank}"
        assert path.exists() and path.read_text() == "second\nfirst\n", f"rank {rank}: atexit did not run\n{out.log}"


ENDING = """
import atexit, sys
from launcher.base.exiting import at_the_end, end_process_at_exit
say = lambda word: lambda: print(word, flush=True)
if sys.argv[1] == "end-first":  # a rank's entry: asked first thing
    end_process_at_exit(0)
at_the_end(say("hook"))  # (logs.py: rank 0's tee drained)
if sys.argv[1] == "hook-first":
    end_process_at_exit(0)
atexit.register(say("script's first"))
atexit.register(say("script's second"))
end_process_at_exit(3)  # a later call changes the code only
"""


@pytest.mark.parametrize("order", ["end-first", "hook-first"])
def test_the_end_of_a_process_runs_the_scripts_atexit_handlers_then_each_hook_once(order):
    """The handlers registered after ``end_process_at_exit`` was first asked (a rank's entry asks first thing) run
    before its end, last in first out; an ``at_the_end`` hook runs once, last, whether it was added before or after
    that; the code is the last one asked."""
    done = subprocess.run([sys.executable, "-c", ENDING, order], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["script's second", "script's first", "hook"], done.stdout
