"""``LAUNCHER_REQUIRE_BEDS=1`` (CI) turns a test's skip for a missing bed into a failure that says so; the skips the
suite chooses (no GPU lent: the only one) stay skips; elsewhere a bed's skip says how to run it
(tests/conftest.py's report hook, driven here as pytest drives it)."""

import pytest

from harness import TESTS

BED_SKIP = "Skipped: the ssh test machines need root and iproute2"


@pytest.fixture
def conftest(request):
    """tests/conftest.py as pytest loaded it (``import conftest`` may find another folder's under pytest-xdist)."""
    path = str(TESTS / "conftest.py")
    return next(p for p in request.config.pluginmanager.get_plugins() if getattr(p, "__file__", None) == path)


def reported(conftest, reason: str):
    class Report:
        skipped, outcome, longrepr = True, "skipped", ("tests/beds/test_x.py", 3, reason)

    class Outcome:
        def get_result(self):
            return report

    report = Report()
    hook = conftest.pytest_runtest_makereport(item=None, call=None)
    next(hook)
    try:
        hook.send(Outcome())
    except StopIteration:
        pass
    return report


def test_a_beds_skip_fails_under_require_beds(conftest, monkeypatch):
    monkeypatch.setenv(conftest.BEDS_ENV, "1")
    report = reported(conftest, BED_SKIP)
    assert report.outcome == "failed"
    assert report.longrepr == (
        "LAUNCHER_REQUIRE_BEDS=1: this test would be skipped (the ssh test machines need root and iproute2): its bed "
        "is missing on this machine"
    )
    assert reported(conftest, "Skipped: no CUDA device: the GPU tests run where one is").outcome == "skipped"
    assert reported(conftest, "Skipped: runs on the one-host cluster only").outcome == "failed"  # (issue 60)


def test_elsewhere_a_beds_skip_says_how_to_run_it(conftest, monkeypatch):
    monkeypatch.delenv(conftest.BEDS_ENV, raising=False)
    report = reported(conftest, BED_SKIP)
    assert report.outcome == "skipped"
    assert report.longrepr[2] == f"the ssh test machines need root and iproute2; HINT: {conftest.HOW_TO_RUN}"
