"""Every script in bench/ still runs (issue 60, item 4): a change that breaks one fails here, not on the day someone
measures with it. Each one answers ``--help`` (all of them in this process, through runpy, as ``python bench/X.py
--help`` runs it), and runs once at its smallest size, the JSON keys it promises present (those of the files
bench/README.md records, bench/scale.json and bench/ssh_head.json; else those its docstring and code name).

A tiny run runs the script's ``main()`` in this process, with the script's command line: its ranks
(``common.run_ranks``) forked from harness.ranks' fork server and its ``python -m launcher`` heads from
harness.heads' preloaded server, so that a run costs its own work rather than an interpreter's imports per process
(the suite is CPU-bound). The scripts that measure across network namespaces (root) run small on loopback in
tests/jobs/test_bench_loopback.py; those that only answer ``--help`` say why in ``HELP_ONLY``."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import REPO, heads, ranks
from harness.run import DEADLINE_S

BENCH = REPO / "bench"
Script = Callable[..., str]  # run_script(name, *argv): what the script printed
HELPERS = {  # not run by hand: covered through the scripts that import or start them
    "common.py": "every script",
    "engine_job.py": "your_loop.py",
    "heal_loop_job.py": "heal_loop.py",
    "heal_loop_jobs.py": "heal_loop.py",
    "heal_loop_net.py": "heal_loop.py",
    "scale_start.py": "scale.py",
    "scale_watch.py": "scale.py",
    "your_loop_jobs.py": "your_loop.py",
}
RUN_HERE = {"auth", "checkpoint", "optimizer", "plot_scale", "reducer", "scale", "ssh_head", "threads"}
LOOPBACK_MODULE = REPO / "tests" / "jobs" / "test_bench_loopback.py"  # root's scripts, run small on loopback there
ON_LOOPBACK = {"compression", "fsdp", "hierarchy", "overlap", "your_loop"}
JOBS_ON_NODES = "launcher jobs on simulated nodes: each node and each rank a fresh interpreter, over 10 CPU-s a job"
HELP_ONLY = {  # why a tiny run would not fit the suite (bench/README.md: each was run by hand at its smallest size)
    "compression_accuracy.py": f"{JOBS_ON_NODES}; 4 of them, each the default job's 10 epochs",
    "end_to_end.py": f"{JOBS_ON_NODES}, in network namespaces; 6 or 7 of them",
    "heal.py": f"{JOBS_ON_NODES}; 2 of them, on 3 nodes",
    "heal_loop.py": f"{JOBS_ON_NODES}; on 3 nodes, 21 steps at least",
    "launch.py": "a pair of whole jobs started as a user starts them (fresh interpreters: their cost is the measure)",
    "ssh_startup.py": "its own ssh machines (scripts/ssh-hosts/start.sh) and a job over ssh on 2 of them",
    "torchft_heal.py": "torchft 0.2.0 in a venv of its own (its docstring's set-up), not in the project's",
    "watch.py": "2 jobs of 2 ranks at the least (a single rank has no watch): 4 fresh rank interpreters, ~11 CPU-s",
}
ENTRY_POINTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)


def test_every_script_runs_small_or_says_why() -> None:
    assert set(ENTRY_POINTS) == {f"{n}.py" for n in RUN_HERE | ON_LOOPBACK} | set(HELP_ONLY)
    missing = [n for n in RUN_HERE if f"test_{n}" not in globals()]
    missing += [n for n in ON_LOOPBACK if f"def test_{n}(" not in LOOPBACK_MODULE.read_text()]
    assert not missing, f"no tiny run of {missing}"


@pytest.fixture(scope="module", autouse=True)
def bench_on_path() -> Iterator[None]:
    """bench/ first on ``sys.path``, as ``python bench/X.py`` has it (the scripts ``from common import ...``; the
    ranks forked for them get this ``sys.path`` too); the scripts' modules forgotten after."""
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(BENCH)):
            del sys.modules[name]


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help(script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [str(BENCH / script), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (a script may put the repo first, as run from anywhere)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(BENCH / script), run_name="__main__")
    assert ended.value.code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"usage: {script} ")


class ForkedHeads:
    """A script's ``subprocess`` module, but its ``python -m launcher`` heads forked from harness.heads' server (a
    command that is no head, or an environment torch would import under differently, runs as it is)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(argv: list, *, cwd: Any = None, env: Any = None, **kw: Any) -> Any:
        """(start_new_session and text: always, as harness.heads starts every head)"""
        where, environ = Path(cwd or os.getcwd()), dict(os.environ if env is None else env)
        return heads.popen(
            [str(a) for a in argv], cwd=where, env=environ, stdout=kw.get("stdout"), stderr=kw.get("stderr")
        )

    def run(
        self, argv: list, *, capture_output: bool = False, check: bool = False, timeout: Any = None, **kw: Any
    ) -> Any:
        if [str(a) for a in argv[:3]] != [sys.executable, "-m", "launcher"]:
            return subprocess.run(argv, capture_output=capture_output, check=check, timeout=timeout, **kw)
        pipe = subprocess.PIPE if capture_output else None
        proc = self.Popen(argv, cwd=kw.get("cwd"), env=kw.get("env"), stdout=pipe, stderr=pipe)
        said: dict[str, str] = {}
        readers = [
            threading.Thread(target=lambda n=n, p=p: said.__setitem__(n, p.read()))
            for n, p in (("out", proc.stdout), ("err", proc.stderr))
            if p is not None
        ]
        for reader in readers:
            reader.start()
        try:
            code = proc.wait(timeout=timeout or DEADLINE_S)
        finally:
            if proc.poll() is None:  # (its own session: the head and what it started)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for reader in readers:
                reader.join()
        done = subprocess.CompletedProcess(argv, code, said.get("out"), said.get("err"))
        if check:
            done.check_returncode()
        return done


@pytest.fixture
def run_script(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Script:
    """``run_script(name, *argv)``: ``python bench/NAME.py ARGV...`` in this process (see the module's docstring);
    what it printed."""

    def run(name: str, *argv: Any) -> str:
        common = importlib.import_module("common")
        monkeypatch.setattr(common, "rank_context", ranks._rank_context)
        module = importlib.import_module(name)
        if hasattr(module, "subprocess"):
            monkeypatch.setattr(module, "subprocess", ForkedHeads())
        monkeypatch.setattr(sys, "argv", [module.__file__, *map(str, argv)])
        module.main()
        return capsys.readouterr().out

    return run


def recorded_keys(name: str) -> set[str]:
    return set(json.loads((BENCH / name).read_text()))


def test_auth(run_script: Script) -> None:
    out = run_script("auth", "--blocks", 1, "--every", 2)
    assert "signed / plain step = " in out


def test_reducer(run_script: Script) -> None:
    out = run_script("reducer", "--steps", 2, "--width", 64, "--depth", 2, "--bucket-mb", 0.01, "--profile")
    assert "bucketed / ddp = " in out
    assert "gradient hooks" in out


def test_optimizer(run_script: Script) -> None:
    out = run_script("optimizer", "--steps", 2)
    assert "trainer (fused)" in out


def test_scale(run_script: Script, tmp_path: Path) -> None:
    """The smallest size, the stall named sooner (bench/scale_watch.py's watch over 8 ranks in 2 processes), the 8
    ranks' start-up in one (bench/scale_start.py)."""
    out = tmp_path / "scale.json"
    small = ("--sizes", "8:2", "--clean-s", 3, "--warn-s", 2, "--lost-after-s", 1, "--hosts", 1)
    run_script("scale", *small, "--json", out)
    figures = json.loads(out.read_text())
    assert set(figures) == recorded_keys("scale.json")
    assert all(len(v) == 1 and v[0] is not None for v in figures.values()), figures


def test_plot_scale(run_script: Script, tmp_path: Path) -> None:
    run_script("plot_scale", BENCH / "scale.json", tmp_path / "scale.png")
    assert (tmp_path / "scale.png").read_bytes().startswith(b"\x89PNG")


def test_ssh_head(run_script: Script, tmp_path: Path) -> None:
    """Two simulated machines (stub ssh, stub cluster.python answering the host check), the head forked."""
    out = tmp_path / "ssh_head.json"
    run_script("ssh_head", "--machines", 2, "--json", out)
    figures = json.loads(out.read_text())
    assert set(figures) == recorded_keys("ssh_head.json")
    assert figures["machines"] == [2]


def test_checkpoint(run_script: Script, tmp_path: Path) -> None:
    """One rank (the worker in the head's own process), a 32-wide MLP, a save every 2 of 4 steps; the three runs."""
    out = tmp_path / "checkpoint.json"
    run_script("checkpoint", "--ranks", 1, "--steps", 4, "--every", 2, "--hidden", 32, "--json", out)
    result = json.loads(out.read_text())
    assert set(result) == {"blocked_ms", "step_ms", "reducer", "machine"}
    assert set(result["blocked_ms"]) == {"sync", "async"} and set(result["step_ms"]) == {"none", "sync", "async"}


def test_threads(run_script: Script) -> None:
    """One rank, 4 steps: the script under the launcher (in the head's process) and under torchrun."""
    out = run_script("threads", "--ranks", 1, "--steps", 4, "--repeats", 1)
    assert "ratio to torchrun" in out and "launcher " in out
