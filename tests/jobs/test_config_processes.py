"""Bad input is refused before any process starts, as the user sees it from ``python -m launcher``: exit code 2,
the value and the fix named, no traceback; ``dry_run=true`` prints the plan and starts nothing. (The rules
themselves: tests/rules/test_config.py.)"""

import pytest

from harness.run import run_launcher


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.nodes=0"], "launcher: error: cluster.nodes=0 must be >= 1"),
        (["model=nope"], "Could not find 'model/nope'"),
        (["data=nope"], "Could not find 'data/nope'"),
        (["train.epoch=3"], "train.epoch=3: train.epoch is not a key of train (did you mean train.epochs?)"),
        (["script=missing.py"], "launcher: error: script='missing.py' does not exist"),
    ],
)
def test_cli_exit_code_2_and_nothing_started(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    result = run_launcher(*overrides, run_dir=run_dir, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (run_dir / "logs").exists() and not (run_dir / "config.yaml").exists()


def test_dry_run_prints_plan_and_starts_nothing(tmp_path):
    result = run_launcher("dry_run=true", "cluster.procs_per_node=4", run_dir=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "layout      : 1 node(s) x 4 rank(s) = world size 4" in result.stdout
    assert "_target_: models.lenet.LeNet" in result.stdout
    assert not (tmp_path / "logs").exists() and not (tmp_path / "config.yaml").exists()
