"""The tests' shared machinery (tests/README.md): what more than one test module needs comes from here or from a
conftest.py, never from another test module (tests/rules/test_house.py checks it).

- ``run``: ``python -m launcher`` as a user types it, bounded by a deadline (one runner, ``run_job``, and its
  wrappers), a background head, the first checkpoint's wait;
- ``ranks``: real gloo ranks without the launcher (``spawn_ranks``, virtual nodes, a frozen job trained on ranks);
- ``config``: the job's config as the launcher composes it (``compose``, ``plan``);
- ``jobs``: the jobs several modules run (the heal job, the failing ranks', the stuck rank's);
- ``checks``: what several modules assert of a finished job (same trajectory, the root cause, the hang named);
- ``probes``: threads watching a running job's processes (a secret on a command line, a stranger writing);
- ``beds``: the test beds' names and helpers (the ssh machines, the network namespaces); their fixtures are in
  tests/beds/conftest.py.

Test modules import these by ``harness.<module>``: tests/conftest.py puts tests/ on ``sys.path``.
"""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent


def path_override(key: str, path: object) -> str:
    """``key='path'``: a Hydra override whose value is a path, quoted (a clone's path may hold ``,``, ``=``, ``(``,
    ``)`` or spaces, which Hydra's grammar would read as its own)."""
    text = str(path).replace("'", "\\'")  # (in Hydra's quotes a backslash escapes a quote only)
    return f"{key}='{text}'"
