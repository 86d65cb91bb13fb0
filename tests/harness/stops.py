"""The stop-signal matrix (issue 51, item 3; issue 58, item 1; docs/running.md, "Exit codes"): SIGINT, SIGTERM and
SIGHUP to the process a user started (the launcher's head; torchrun; node 0's launcher of a job started by hand) in
every launch mode, for the built-in trainer and for a ``script=`` job (where paths are the same, one cell holds
them: ``runs``, ``HUP_CELLS``, ``DIAGONAL``). Each cell is one job, stopped once it runs; it
must end with the documented exit code and the stop line, the trainer with a checkpoint written at the stop (none
before: ``TRAINER`` writes none on its own) and the line naming it, each of its ranks saying it stopped on the signal
sent (``check_trainer_ranks``), the script (``STOP_SCRIPT``: a handler that
notes the signal, the ranks agree on it at their next all_reduce, save and exit 0) having got the signal itself on
every rank (Slurm: its SIGTERM), saved, run its atexit handler, and the line saying each rank exited 0; nothing of
the job may be left ``LEFT_S`` after it ended.

A signal arrives as it does for a user: SIGINT and SIGHUP at the process group (Ctrl-C; the terminal closed, its
shell passing the hang-up on to its jobs), SIGTERM at the process alone (``kill``, a scheduler, a CI runner).

``MODULE_OF_MODE`` says which test module runs a mode's cells (each cell a test of its own, its id
``<mode>-<signal>-<program>``); tests/rules/test_signal_matrix.py checks that the table is the whole product and
that each module parametrizes its modes' cells. A module drives its cells side by side (``drive_all``: the jobs
mostly wait on start-up and on each other, and one at a time they cost the suite minutes), then checks each."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import REPO, TESTS, heads, path_override
from harness.run import user_env

SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "HUP": signal.SIGHUP}
PROGRAMS = ("trainer", "script")
MODULE_OF_MODE = {
    "local": "tests/jobs/test_signals.py",
    "torchrun": "tests/jobs/test_signals.py",
    "by-hand": "tests/jobs/test_signals.py",
    "sim": "tests/jobs/test_signals_sim.py",
    "sim-healing": "tests/jobs/test_signals_sim.py",
    "ssh": "tests/beds/test_signals_ssh.py",
    "slurm": "tests/beds/test_slurm.py",
}
LOOP_SCRIPT = TESTS / "scripts" / "loop_script.py"  # (no handler: it ends as Python ends it)
STOP_SCRIPT = TESTS / "scripts" / "stop_script.py"
# the trainer checkpoints at the stop only (the default lenet on digits: 22 steps an epoch); a step is logged each
# step (metrics.jsonl: the job is training); no link measured at the start (suite time)
TRAINER = ("train.epochs=200", "train.log_every_steps=1", "train.checkpoint_every_steps=100000")
TRAINER += ("comm.hierarchical=false",)
READY_S = 240.0  # from the start to a training step or every script rank running (several jobs start at once)
END_S = 60.0  # from the signal to the end of every process started (STOP_DEADLINE_S bounds a rank's own stop)
LEFT_S = 15.0  # nothing of the job left this long after it ended
SCRIPT_STOPPED = "how the script's ranks ended: "
SCRIPT_SAID = re.compile(r"how the script's ranks ended: (.*) \(the launcher writes no checkpoint for a script=")
RANK_STOPPED = re.compile(r"stopped at step \d+ (?:on (SIG\w+)|\(another rank was signalled\)): checkpoint written")


@dataclass(frozen=True)
class Cell:
    mode: str
    sig: str
    program: str

    @property
    def id(self) -> str:
        return f"{self.mode}-{self.sig}-{self.program}"

    @property
    def signum(self) -> signal.Signals:
        return SIGNALS[self.sig]

    @property
    def code(self) -> int:
        """The documented exit code of the process signalled: torchrun's own is 1 (its SignalException)."""
        return 1 if self.mode == "torchrun" else 128 + self.signum

    @property
    def ranks_got(self) -> str:
        """The signal each script rank gets: the one sent (a Slurm job's head cancels it: Slurm's SIGTERM)."""
        return "SIGTERM" if self.mode == "slurm" else f"SIG{self.sig}"

    @property
    def trainer_ranks_got(self) -> str | None:
        """The signal the trainer's ranks say they stopped on: the one sent (None: not checked; on Slurm the head
        stops the job through Slurm, its tasks are sent SIGUSR2: tests/beds/test_slurm.py says so)."""
        return None if self.mode == "slurm" else f"SIG{self.sig}"

    def program_args(self, run_dir: Path) -> tuple[str, ...]:
        if self.program == "trainer":
            return TRAINER
        return (path_override("script", STOP_SCRIPT), f"script_args=[{marks(run_dir)}]")


# SIGINT and SIGTERM take different paths in every mode (the process group, the process alone): each mode has both.
# What a program does with the stop (the trainer's checkpoint at one step, the script's own handler and atexit) is
# the same in every mode, and each relay of a head (torchrun, by hand, simulated nodes, ssh) passes the signal on by
# its own name whatever runs under it: these modes run the diagonal (SIGINT to the trainer, SIGTERM to the script),
# where `local` and `slurm` (whose SIGTERM is scancel's, its own path) run both programs under both signals (issue
# 60, item 3: suite time; the ranks' names of the signal are checked in the trainer's cells too). SIGHUP takes
# SIGINT's path (at the process group; the same stop, under its own name and code 129) except where the launcher
# turns it into another word: it is run where that happens or is seen end to end, and not again where it would only
# repeat a SIGINT cell:
HUP_CELLS = {
    ("local", "trainer"),  # the exit code 129, the stop line and the checkpoint, end to end
    ("local", "script"),  # the terminal closed: the script's own ranks get SIGHUP from the group
    ("by-hand", "script"),  # the relay's word for it (launch/nodes/control.py: Control.HUP), told to another machine
    ("slurm", "trainer"),  # the Slurm head passes it on as a SIGTERM (scancel)
    ("slurm", "script"),
}


WHOLE_MODES = ("local", "slurm")  # both programs under SIGINT and SIGTERM; the other modes: DIAGONAL
DIAGONAL = {("INT", "trainer"), ("TERM", "script")}


def runs(mode: str, sig: str, program: str) -> bool:
    if sig == "HUP":
        return (mode, program) in HUP_CELLS
    return mode in WHOLE_MODES or (sig, program) in DIAGONAL


def cells(*modes: str) -> list[Cell]:
    return [
        Cell(mode, sig, program)
        for mode in modes
        for sig in SIGNALS
        for program in PROGRAMS
        if runs(mode, sig, program)
    ]


def marks(run_dir: Path) -> Path:
    """Where the loop script's ranks say they run (beside the run dir: a marker is no file of the run)."""
    return run_dir.parent / f"{run_dir.name}-running"


@dataclass
class Outcome:
    """What one cell's job did: each started process's exit code (the signalled one first) and log, the
    checkpoints before the signal and after the end, what was left of it; ``failed``: why the cell could not be
    driven to its end (not ready, still running)."""

    cell: Cell
    run_dir: Path
    codes: list[int | None] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    before: list[Path] = field(default_factory=list)
    after: list[Path] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    failed: str = ""

    def tail(self) -> str:
        return "\n".join(f"--- log {i}:\n{log[-2500:]}" for i, log in enumerate(self.logs))


Starter = Callable[[], Sequence[subprocess.Popen]]  # (harness.heads.Process too: the same surface)


def popen_logged(argv: list[str], log: Path, env: dict[str, str] | None = None) -> heads.Process:
    """A head (or torchrun) in its own session, as a shell starts a foreground job, its stderr into ``log``."""
    with open(log, "w") as stderr:
        return heads.popen(argv, cwd=REPO, env=user_env(env), stdout=subprocess.DEVNULL, stderr=stderr)


def processes_of(run_dir: Path) -> list[str]:
    """``pid: command line`` of every live process on this host whose command line (or title) names ``run_dir``."""
    found, needle = [], str(run_dir).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if needle in cmdline and state != "Z":
            found.append(f"{proc.name}: " + cmdline.replace(b"\0", b" ").decode(errors="replace")[:160])
    return found


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("checkpoints/step-*.pt"))


def ready(cell: Cell, run_dir: Path, ranks: int) -> bool:
    if cell.program == "script":
        return all((marks(run_dir) / f"running-{r}").exists() for r in range(ranks))
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and '"step"' in metrics.read_text()


def drive(
    cell: Cell, start: Starter, run_dir: Path, logs: Sequence[Path], ranks: int, left: Callable[[], list[str]]
) -> Outcome:
    """Start the cell's processes (``start``: the one to signal first, their stderr in ``logs``), wait until the
    job trains (or every script rank runs), send the signal, wait for every process to end, then up to ``LEFT_S``
    for ``left()`` to come back empty; whatever is still running then is killed (the next cell starts clean)."""
    out = Outcome(cell, run_dir)
    marks(run_dir).mkdir(parents=True, exist_ok=True)
    procs = list(start())
    try:
        deadline = time.monotonic() + READY_S
        while not ready(cell, run_dir, ranks):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                out.failed = f"not running within {READY_S:.0f} s (or ended: {[p.poll() for p in procs]})"
                return out
            time.sleep(0.1)
        out.before = checkpoints(run_dir)
        (os.killpg if cell.signum != signal.SIGTERM else os.kill)(procs[0].pid, cell.signum)
        ends = time.monotonic() + END_S
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, ends - time.monotonic()))
            except subprocess.TimeoutExpired:
                out.failed = f"process {proc.pid} still running {END_S:.0f} s after SIG{cell.sig}"
        gone = time.monotonic() + LEFT_S
        while (rest := left()) and time.monotonic() < gone:
            time.sleep(0.2)
        out.left = rest
        return out
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for line in left():
            pid = line.split(":")[0]
            if pid.isdigit() and int(pid) > 0:  # (not a line that names no process: a Slurm job)
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
        out.codes = [p.poll() for p in procs]
        out.logs = [path.read_text() if path.exists() else "" for path in logs]
        out.after = checkpoints(run_dir)


def selected(request: pytest.FixtureRequest) -> list[Cell]:
    """The cells of the requesting module that this session runs (``-k``, a node id: only those are driven)."""
    items = [i for i in request.session.items if i.module is request.module and hasattr(i, "callspec")]
    return list(dict.fromkeys(i.callspec.params["cell"] for i in items if "cell" in i.callspec.params))  # (once)


def job(
    cell: Cell,
    run_dir: Path,
    argvs: Callable[[], list[list[str]]],
    logs: list[Path],
    env: dict | None = None,
    left: Callable[[], list[str]] | None = None,
) -> Callable[[], Outcome]:
    """A cell's driver: its job's processes (``argvs()``, each with its log: the signalled one first) started when
    it runs, 2 ranks; ``left``: what must be gone after it (default: the processes that name ``run_dir``)."""

    def run() -> Outcome:
        run_dir.mkdir(parents=True)
        start = lambda: [popen_logged(argv, log, env) for argv, log in zip(argvs(), logs)]  # noqa: E731
        return drive(cell, start, run_dir, logs, 2, left or (lambda: processes_of(run_dir)))

    return run


def drive_module(request: pytest.FixtureRequest, base: Path, driver: Callable, at_once: int = 3) -> dict:
    """A module fixture's work: the cells this session selected from the module, ``driver(cell, base)`` each."""
    return drive_all(lambda cell: driver(cell, base), selected(request), at_once)


def drive_all(
    driver: Callable[[Cell], Callable[[], Outcome]], chosen: list[Cell], at_once: int = 3
) -> dict[Cell, Outcome]:
    """The chosen cells' drivers (``driver(cell)``), ``at_once`` of them side by side."""
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = {cell: pool.submit(driver(cell)) for cell in chosen}
        return {cell: future.result() for cell, future in futures.items()}


def script_ends(log: str) -> dict[int, str]:
    """How each script rank ended, as the stop line in ``log`` says (``ranks 0, 1 on h exited 0; ...``)."""
    said = SCRIPT_SAID.search(log)
    ends: dict[int, str] = {}
    for part in said.group(1).split("; ") if said else []:
        ranks, _, rest = part.removeprefix("ranks ").removeprefix("rank ").partition(" on ")
        ends.update((int(r), rest.split(" ", 1)[1]) for r in ranks.split(", "))
    return ends


def check_script(cell: Cell, out: Outcome, log: str, ranks: Sequence[int]) -> None:
    """A script cell's promises: every rank got the signal itself, saved and ran its atexit handler; the stop line in
    ``log`` says each of ``ranks`` (those that process knows: its own machine's, torchrun's rank 0) exited 0."""
    folder = marks(out.run_dir)
    # each node (Slurm's tasks, the heads' node processes) is signalled on its own: a rank may save as told by its
    # peer's agreement before its own signal arrives (seen in full runs: slurm, sim-healing); one must have got it
    allowed = {cell.ranks_got, "told"}
    got = {}
    for rank in (0, 1):
        assert (folder / f"atexit-{rank}").exists(), f"{cell.id}: rank {rank}'s atexit did not run\n{out.tail()}"
        saved = folder / f"saved-{rank}"
        got[rank] = saved.read_text() if saved.exists() else "nothing saved"
        assert got[rank] in allowed, f"{cell.id}: rank {rank}: {got[rank]}, not {cell.ranks_got}\n{out.tail()}"
    assert cell.ranks_got in got.values(), f"{cell.id}: no rank got {cell.ranks_got} itself: {got}\n{out.tail()}"
    ends = script_ends(log)
    assert ends == {r: "exited 0" for r in ranks}, f"{cell.id}: the stop line says {ends}\n{out.tail()}"


def check_trainer_ranks(cell: Cell, out: Outcome) -> None:
    """A trainer cell's ranks: each one's own stop line (its log) names the signal sent, or says another rank was
    signalled (the ranks agree at a step; one may learn it from a peer before its own signal arrives), and one names
    it. (The head's stop line alone passed with ranks that said another signal: issue 60, item 6, edge 7.)"""
    if cell.program != "trainer" or cell.trainer_ranks_got is None:
        return
    said = {}
    for log in sorted((out.run_dir / "logs").glob("rank-*.log")):
        stops = RANK_STOPPED.findall(log.read_text())
        said[log.name] = (stops[-1] or "another rank") if stops else "no stop line"
    assert set(said.values()) <= {cell.trainer_ranks_got, "another rank"}, f"{cell.id}: {said}\n{out.tail()}"
    assert cell.trainer_ranks_got in said.values(), f"{cell.id}: no rank says {cell.trainer_ranks_got}: {said}"


def stop_line(cell: Cell, out: Outcome) -> str:
    """The line the signalled process's log must hold (a script's: its start, ``check_script`` reads the rest);
    asserts the trainer's checkpoint at the stop first."""
    stopped = f"launcher: stopped by SIG{cell.sig}; "
    if cell.program == "script":
        return stopped + SCRIPT_STOPPED
    new = [p for p in out.after if p not in out.before]
    assert len(new) == 1 and out.before == [], f"checkpoints before {out.before}, after {out.after}\n{out.tail()}"
    step = int(new[0].stem.split("-")[1])
    return (
        f"{stopped}the newest checkpoint is {new[0]} (step {step}): run again with hydra.run.dir={out.run_dir} to "
        "continue from it"
    )


def check(out: Outcome, codes: Sequence[int] | None = None, traceback_ok: bool = False) -> None:
    """The cell's promises: it was driven to its end, the exit codes (``codes``: every process's; default the
    signalled one's documented code), the stop line in the signalled process's log, no traceback there (torchrun
    prints its own: ``traceback_ok``), nothing left."""
    cell = out.cell
    assert not out.failed, f"{cell.id}: {out.failed}\n{out.tail()}"
    assert out.codes == list(codes or [cell.code]), f"{cell.id}: exit codes {out.codes}\n{out.tail()}"
    line = stop_line(cell, out)
    assert line in out.logs[0], f"{cell.id}: no line {line!r}\n{out.tail()}"
    if cell.program == "script":  # (torchrun's rank 0 and by hand node 0's launcher know their own ranks only)
        check_script(cell, out, out.logs[0], [0] if cell.mode in ("torchrun", "by-hand") else [0, 1])
    check_trainer_ranks(cell, out)
    assert traceback_ok or "Traceback" not in out.logs[0], f"{cell.id}: a traceback\n{out.tail()}"
    assert not out.left, f"{cell.id}: still running {LEFT_S:.0f} s after the job ended:\n" + "\n".join(out.left)
