"""A new user's command line (issue 36): typos refused with "did you mean" and exit 2 (with ``+`` too: it used to add
the typo beside the real key and run 10 epochs), and an own model class given by ``model._target_`` gets only the
keys the user gives (LeNet's ``in_channels`` leaked into it), or an error naming the keys it does not take; a dry
run builds the model and reports its error before anything starts."""

import pytest

from harness.run import run_launcher
from launcher.commands.command_line import hydra_overrides

MODEL = """
from torch import nn


class CharGRU(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16):
        super().__init__()
        self.emb, self.out = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.emb(x))


def broken(size: int = 3):
    raise RuntimeError("no weights for size 3")
"""


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("+train.epoch=2", "train.epoch is not a key of train (did you mean train.epochs?)"),
        ("train.epoch=2", "train.epoch is not a key of train (did you mean train.epochs?)"),
        ("+trian.epochs=2", "trian is not a key of the job (did you mean train?)"),
        ("comm.bucket_cap=2", "comm.bucket_cap is not a key of comm (did you mean comm.bucket_cap_mb?)"),
    ],
)
def test_a_typo_is_refused_naming_the_key_meant(tmp_path, override, said):
    result = run_launcher(override, "dry_run=true", run_dir=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"launcher: error: {override}: {said}" in result.stderr
    assert "full_key" not in result.stderr  # not Hydra's raw text


def test_a_cluster_kinds_own_keys_are_checked_against_that_kind(tmp_path):
    result = run_launcher("+cluster=slurm", "cluster.partiton=gpu", "dry_run=true", run_dir=tmp_path, timeout=60)
    assert result.returncode == 2 and "did you mean cluster.partition?" in result.stderr
    result = run_launcher("+cluster=slurm", "cluster.partition=gpu", "dry_run=true", run_dir=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def own_package(tmp_path):
    (tmp_path / "charlm").mkdir()
    (tmp_path / "charlm" / "__init__.py").write_text("")
    (tmp_path / "charlm" / "model.py").write_text(MODEL)
    return {"PYTHONPATH": str(tmp_path)}


def test_an_own_model_gets_only_the_keys_given(tmp_path, own_package):
    given = ("model._target_=charlm.model.CharGRU", "+model.hidden=8", "dry_run=true")
    result = run_launcher(*given, run_dir=tmp_path / "run", env=own_package, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "model:\n  _target_: charlm.model.CharGRU\n  hidden: 8\n" in result.stdout  # no in_channels, image_size
    assert "model       : CharGRU, 544 parameters" in result.stdout  # built on the head: 32*8 + (8*32 + 32)


def test_keys_an_own_model_does_not_take_are_named_with_the_fix(tmp_path, own_package):
    given = ("model=mlp", "model._target_=charlm.model.CharGRU", "dry_run=true")
    result = run_launcher(*given, run_dir=tmp_path / "run", env=own_package, timeout=60)
    assert result.returncode == 2
    assert (
        "model._target_=charlm.model.CharGRU does not take depth, image_size, in_channels, num_classes "
        "(it takes: vocab, hidden); HINT: drop them (~model.depth ~model.image_size ~model.in_channels "
        "~model.num_classes)"
    ) in result.stderr


def test_a_dry_run_builds_the_model_and_reports_its_error(tmp_path, own_package):
    result = run_launcher("model._target_=charlm.model.broken", "dry_run=true", run_dir=tmp_path, env=own_package)
    assert result.returncode == 2
    assert (
        "launcher: error: model._target_='charlm.model.broken' failed to build: RuntimeError: no weights for size 3; "
        "HINT: the keys under model are its arguments: give the one it names as model.NAME=VALUE"
    ) in result.stderr
    assert not (tmp_path / "logs").exists() and "Traceback" not in result.stderr  # nothing started, no traceback


def test_hydra_flags_and_their_values_are_not_overrides():
    args = ["-m", "--config-name", "other", "train.epochs=2", "-cd", "/x", "--cfg", "job", "+cluster=sim"]
    assert hydra_overrides(args) == ["train.epochs=2", "+cluster=sim"]


def test_a_dry_run_leaves_nothing(tmp_path):
    result = run_launcher("dry_run=true", run_dir=tmp_path / "run", timeout=60)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "run").exists()  # no run dir, no .hydra in it


def test_the_printed_resume_command_continues_the_run_as_printed(tmp_path):
    """ "run again with hydra.run.dir=X" was refused as a different job unless every override was repeated: the
    run dir's own overrides are taken again when hydra.run.dir is all the command line says."""
    run_dir = tmp_path / "run"
    first = run_launcher("model=mlp", "cluster.procs_per_node=1", "train.max_steps=4", run_dir=run_dir)
    assert first.returncode == 0, first.stderr
    again = run_launcher(run_dir=run_dir)
    assert again.returncode == 0, again.stderr
    said = (
        f"[launcher] continuing {run_dir} with its own overrides: model=mlp cluster.procs_per_node=1 train.max_steps=4"
    )
    assert said in again.stderr and "resumed from" in again.stderr
