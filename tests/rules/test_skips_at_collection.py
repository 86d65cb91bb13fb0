"""``LAUNCHER_REQUIRE_BEDS=1`` (CI) sees a skip while collecting too (a module-level ``pytest.importorskip`` or
``pytest.skip(allow_module_level=True)``): a collection error that says so, as a test's own skip fails; elsewhere it
says how to run it. Only a GPU test may skip (tests/README.md): no other reason stays a skip, and the local Slurm's
tests are generated for the netns cluster only where ``NETNS_TOO`` names them, not generated and skipped there
(tests/conftest.py's hooks, driven here as pytest drives them)."""

from types import SimpleNamespace

import pytest
from _pytest.reports import CollectReport

from harness import TESTS

IMPORT_SKIP = "Skipped: could not import 'matplotlib': No module named 'matplotlib'"


@pytest.fixture
def conftest(request):
    """tests/conftest.py as pytest loaded it (``import conftest`` may find another folder's under pytest-xdist)."""
    path = str(TESTS / "conftest.py")
    return next(p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path)


def collected(conftest, reason: str) -> CollectReport:
    """What the collection of a module that skipped with ``reason`` reports, after the conftest's hook."""
    report = CollectReport("tests/rules/test_x.py", "skipped", ("tests/rules/test_x.py", 10, reason), [])
    hook = conftest.pytest_make_collect_report(collector=None)
    next(hook)
    with pytest.raises(StopIteration):
        hook.send(SimpleNamespace(get_result=lambda: report))
    return report


def test_a_module_level_skip_fails_under_require_beds(conftest, monkeypatch):
    monkeypatch.setenv(conftest.BEDS_ENV, "1")
    report = collected(conftest, IMPORT_SKIP)
    assert report.outcome == "failed"
    assert report.longrepr == (
        "LAUNCHER_REQUIRE_BEDS=1: every test of tests/rules/test_x.py would be skipped (could not import 'matplotlib': "
        "No module named 'matplotlib'): its bed is missing on this machine"
    )


def test_elsewhere_a_module_level_skip_says_how_to_run_it(conftest, monkeypatch):
    monkeypatch.delenv(conftest.BEDS_ENV, raising=False)
    report = collected(conftest, IMPORT_SKIP)
    assert report.outcome == "skipped"
    assert report.longrepr == (
        "tests/rules/test_x.py",
        10,
        f"could not import 'matplotlib': No module named 'matplotlib'; HINT: {conftest.HOW_TO_RUN}",
    )


def test_only_the_gpu_tests_may_skip(conftest, monkeypatch):
    monkeypatch.setenv(conftest.BEDS_ENV, "1")
    assert conftest.MAY_SKIP == ("no CUDA device",)
    assert collected(conftest, "Skipped: no CUDA device: the GPU tests run where one is").outcome == "skipped"
    assert collected(conftest, "Skipped: runs on the one-host cluster only").outcome == "failed"


class Definition:
    def __init__(self) -> None:
        self.marks: list[pytest.Mark] = []

    def add_marker(self, marker, append: bool = True) -> None:
        self.marks.insert(len(self.marks) if append else 0, marker.mark)


def generated(conftest, name: str, fixtures: tuple[str, ...] = ("slurm", "tmp_path")) -> list[pytest.Mark]:
    """The marks the conftest's ``pytest_generate_tests`` gives test ``name`` of a module like test_slurm.py."""
    module = SimpleNamespace(NETNS_TOO={"test_on_both"})
    definition = Definition()
    metafunc = SimpleNamespace(
        module=module, fixturenames=list(fixtures), function=SimpleNamespace(__name__=name), definition=definition
    )
    conftest.pytest_generate_tests(metafunc)
    return definition.marks


def test_a_slurm_test_is_generated_for_the_netns_cluster_only_where_netns_too_names_it(conftest):
    (one_host,) = generated(conftest, "test_one_host_only")
    assert (one_host.name, one_host.args, one_host.kwargs) == (
        "parametrize",
        ("slurm", ["one-host"]),
        {"indirect": True},
    )
    assert generated(conftest, "test_on_both") == []  # (the fixture's params: one-host and netns)
    assert generated(conftest, "test_without_the_cluster", ("tmp_path",)) == []
