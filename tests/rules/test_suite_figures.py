"""The README's test counts and times are the last recorded run's (issue 60, item 5): ``./scripts/test.sh
--durations [--fast]`` writes them (scripts/suite_figures.py) to tests/suite_figures.json and the README; a README
figure typed by hand, or a record older than the README's, fails here. Recording says where a lane is over its
budget (``suite_figures.BUDGET``)."""

import importlib.util
import json

import pytest

from harness import REPO

spec = importlib.util.spec_from_file_location("suite_figures", REPO / "scripts" / "suite_figures.py")
assert spec and spec.loader
figures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(figures)

RECORD = json.loads(figures.FIGURES.read_text())
COUNT_MARGIN, TIME_MARGIN = 0.02, 0.15  # a figure rounded or typed a little apart passes; a stale one does not


@pytest.mark.parametrize("lane", ("fast", "full"))
def test_the_readme_states_the_recorded_figures(lane):
    found = figures.marker(lane).search(figures.README.read_text())
    assert found, f"README.md lost its <!-- suite:{lane} --> markers (scripts/suite_figures.py writes between them)"
    stated, recorded = figures.read_sentence(found[2]), RECORD[lane]
    for key in ("passed", "skipped"):
        assert abs(stated[key] - recorded[key]) <= max(2, COUNT_MARGIN * recorded[key]), (lane, key, stated, recorded)
    for key in ("pytest_s", "whole_s"):
        assert abs(stated[key] - recorded[key]) <= TIME_MARGIN * recorded[key] + 1, (lane, key, stated, recorded)
    assert (stated["date"], stated["cores"]) == (recorded["date"], recorded["cores"]), (stated, recorded)


def test_the_budget_is_said_when_a_lane_is_over_it():
    fig = {"passed": 9, "skipped": 0, "pytest_s": 50.0, "whole_s": 80.0, "date": "2026-12-02", "cores": 2}
    assert figures.over_budget("fast", fig) == ["pytest_s 50 s > 45 s"]
    assert figures.over_budget("full", fig | {"whole_s": 900.0}) == []


def test_the_sentence_reads_back_as_written():
    fig = {"passed": 1234, "skipped": 3, "pytest_s": 41.0, "whole_s": 842.0, "date": "2026-12-02", "cores": 2}
    text = figures.sentence("full", fig)
    assert text == "1,234 tests passed, 3 skipped, pytest 41 s, 14.0 min in all (2026-12-02, 2-core box)"
    assert figures.read_sentence(text) == fig | {"whole_s": 840.0}
    with pytest.raises(ValueError, match="not a suite figures sentence"):
        figures.read_sentence("1,234 tests in about 14 min")
