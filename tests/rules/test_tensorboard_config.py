"""train.tensorboard=true without the tensorboard package is refused when the job is planned, before any rank
starts, naming the value and the fix; the records' numbers become TensorBoard tags as the docs say. (The event files
a job writes: tests/jobs/test_tensorboard.py.)"""

import importlib.util

import pytest

from harness.config import plan
from launcher.config import ConfigError
from launcher.train.metrics import scalars


def without_tensorboard(monkeypatch):
    """This interpreter as if the tensorboard package were not installed (the launcher looks it up, never imports
    it); every other module is found as before."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "tensorboard" else real(name, *a, **k)
    )


def test_tensorboard_without_the_package_is_a_config_error_naming_the_fix(monkeypatch):
    without_tensorboard(monkeypatch)
    with pytest.raises(ConfigError) as info:
        plan("train.tensorboard=true")
    assert str(info.value) == (
        "train.tensorboard=true, but the tensorboard package is not installed (torch's SummaryWriter needs it); "
        "HINT: pip install tensorboard (in this checkout: pip install -e '.[tensorboard]'), or train.tensorboard=false"
    )
    job, _ = plan()  # off (the default): the package is not needed
    assert job.train.tensorboard is False
    job, _ = plan("doctor=true", "train.tensorboard=true")  # the doctor writes no events: nothing to check
    assert job.doctor


def test_tensorboard_with_the_package_plans():
    job, _ = plan("train.tensorboard=true")
    assert job.train.tensorboard is True


def test_every_numeric_field_of_a_record_is_a_scalar_tagged_by_its_kind():
    train = {"kind": "train", "step": 8, "epoch": 0, "loss": 1.5, "lr": 0.1, "samples_per_s": 900, "note": "x"}
    assert scalars(train) == {"train/epoch": 0.0, "train/loss": 1.5, "train/lr": 0.1, "train/samples_per_s": 900.0}
    evaluated = {"kind": "eval", "step": 8, "epoch": 0, "test_loss": 0.7, "test_accuracy": None, "flag": True}
    assert scalars(evaluated) == {"eval/epoch": 0.0, "eval/loss": 0.7}  # no accuracy (train.loss gives none)
