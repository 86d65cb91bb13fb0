"""harness.heads: a head forked from the preloaded server is the ``python -m launcher`` a fresh interpreter runs,
seen from outside (console, exit code, session, environment, working directory)."""

import subprocess
import sys

from harness import REPO, heads, path_override
from harness.run import user_env

PROBE = "import os, sys; print(os.getcwd(), os.getsid(0) == os.getpid(), os.environ.get('PROBE'), sys.argv[0])"


def both(*args: str, env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of ``python -m launcher ARGS`` forked, then fresh."""
    results = []
    for fresh in (False, True):
        argv = [sys.executable, "-m", "launcher", *args]
        proc = heads.popen(
            argv, cwd=REPO, env=user_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, fresh=fresh
        )
        assert isinstance(proc, subprocess.Popen) == fresh, type(proc)
        out, err = proc.stdout.read(), proc.stderr.read()
        results.append((proc.wait(timeout=60), out, err))
    return results


def test_a_forked_head_prints_and_ends_as_a_fresh_one():
    forked, fresh = both("--help")
    assert forked == fresh and forked[0] == 0 and "== Exit codes ==" in forked[1], (forked, fresh)
    forked, fresh = both("cluster.procs_per_node=0", "hydra.run.dir=/nonexistent/never")
    assert forked == fresh and forked[0] != 0 and "cluster.procs_per_node" in forked[2], (forked, fresh)


def test_a_forked_head_has_its_own_session_environment_and_directory(tmp_path):
    """A one-rank ``script=`` job runs its script in the head's own process: the script sees the head."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"{PROBE}\n")
    args = (path_override("script", probe), "cluster.procs_per_node=1", f"hydra.run.dir={tmp_path / 'run'}")
    forked, fresh = both(*args, env={"PROBE": "yes"})
    line = f"{REPO} True yes {probe}"
    assert forked[0] == fresh[0] == 0 and line in forked[1] and line in fresh[1], (forked, fresh)


def test_an_environment_changed_at_import_time_gets_a_server_of_its_own(monkeypatch):
    """A variable torch may read at import, set in this process after the server imported (an in-process launch
    sets one): the next head is forked from a new server that imported under it; the old one ends."""
    argv = [sys.executable, "-m", "launcher", "--help"]
    first = heads.popen(argv, cwd=REPO, env=user_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert first.wait(timeout=60) == 0
    old = heads._server
    monkeypatch.setenv("TORCH_LAUNCHER_TEST_DRIFT", "1")
    second = heads.popen(argv, cwd=REPO, env=user_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert isinstance(second, heads.Head) and second.wait(timeout=60) == 0
    assert heads._server is not old and old is not None and old.wait(timeout=30) == 0
