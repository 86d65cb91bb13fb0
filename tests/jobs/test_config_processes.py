"""Bad input is refused before any process starts, as the user sees it from ``python -m launcher``: exit code 2,
the value and the fix named, no traceback; ``dry_run=true`` prints the plan and starts nothing. (The rules
themselves: tests/rules/test_config.py.)"""

import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from harness import REPO
from harness.config import compose
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


def test_help_is_a_manual_on_one_screen_without_torch():
    """``python -m launcher --help``: the modes, the most used overrides (each a real key), the config groups as
    conf/ has them (no internal ``*_schema`` entry), the exit codes, where the docs are; printed without importing
    torch."""
    probe = (
        "import runpy, sys\ntry:\n    runpy.run_module('launcher', run_name='__main__')\nexcept SystemExit:\n    pass\n"
    )
    probe += "print('torch imported:', 'torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", probe, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    out = run.stdout
    assert out.endswith("torch imported: False\n"), (out[-500:], run.stderr[-2000:])
    for mode in ("python -m launcher  ", "torchrun", "+cluster=sim", "+cluster=slurm", "+cluster=ssh", "node_rank="):
        assert mode in out, mode
    assert "_schema" not in out
    groups = dict(re.findall(r"^  \+?(\w+): ([\w, ]+)$", out, re.M))
    on_disk = {g.name: ", ".join(sorted(p.stem for p in g.glob("*.yaml"))) for g in (REPO / "conf").iterdir()}
    assert groups == {name: options for name, options in on_disk.items() if options}, groups
    overrides = out.split("== Most used overrides ==")[1].split("==")[0]
    keys = re.findall(r"^  ([\w.]+)=", overrides, re.M)
    assert len(keys) >= 10, keys
    config = compose()
    absent = object()
    named = [k for k in keys if k not in ("model", "data", "hydra.run.dir")]  # (groups, Hydra's own)
    unknown = [k for k in named if OmegaConf.select(config, k, default=absent) is absent]
    assert not unknown, unknown
    assert re.search(r"== Exit codes ==\n  0 .*; 1 .*; 2 .*\n.*130 / 143 / 129 .*SIGHUP.*\n.*script= job", out), out
    named_pages = re.findall(r"(docs/[\w-]+\.md)", out)
    assert "docs/" in out and all((REPO / page).is_file() for page in named_pages), named_pages  # where the docs are
