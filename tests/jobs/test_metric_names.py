"""Issue 48: a metric is reported under its own name everywhere (the console, metrics.jsonl, summary.json,
TensorBoard, the curves), over the whole evaluation, and "accuracy" only where it was computed; the end of a run
evaluates the final model. The Hugging Face-shaped example (dict samples, an output with loss and logits) trains
through the launcher."""

import json

import pytest

from harness.run import run_launcher
from launcher.base.run_dir import RunDir
from launcher.commands.plot import load_metrics, score_names

EXAMPLE = (
    "model=text_classifier",
    "data=text_classification",
    "data.kwargs.train_samples=512",
    "data.kwargs.test_samples=256",
    "train.loss=model",
    "+train.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
    "+train.metrics.f1.num_classes=2",
    "train.batch_size=32",
    "train.max_steps=24",  # 16 steps an epoch: the end is mid-epoch 1, and evaluated
    "train.log_every_steps=4",
)


@pytest.mark.slow
def test_a_metric_is_reported_under_its_name_everywhere(tmp_path):
    pytest.importorskip("tensorboard", reason="the test extra brings tensorboard: pip install -e '.[test]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_launcher(*EXAMPLE, "train.tensorboard=true", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 1 step 24: test f1 " in result.stderr and "test accuracy" not in result.stderr
    trained, evals = load_metrics(RunDir(tmp_path))
    assert [e["step"] for e in evals] == [16, 24]  # after epoch 0, and the final model
    assert all(set(e) == {"kind", "step", "epoch", "test_loss", "test_f1"} for e in evals), evals
    assert trained[-1]["loss"] < trained[0]["loss"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_metrics"] == {"f1": evals[-1]["test_f1"]} and summary["test_accuracy"] is None
    assert summary["test_loss"] == evals[-1]["test_loss"] and 0.0 < summary["test_metrics"]["f1"] <= 1.0
    board = EventAccumulator(str(RunDir(tmp_path).tensorboard), size_guidance={"scalars": 0})
    board.Reload()
    tags = set(board.Tags()["scalars"])
    assert {"eval/f1", "eval/loss"} <= tags and "eval/accuracy" not in tags, tags
    assert score_names(evals) == ["f1"]  # the curves' metrics panel: one line, f1


def test_the_curves_name_each_metric_and_accuracy_only_where_computed():
    evals = [{"kind": "eval", "step": 4, "epoch": 0, "test_loss": 1.0, "test_accuracy": 0.5, "test_auroc": 0.7}]
    assert score_names(evals) == ["accuracy", "auroc"]
    assert score_names([{"kind": "eval", "step": 4, "epoch": 0, "test_loss": 1.0}]) == []


@pytest.mark.slow
def test_a_metric_that_does_not_take_the_models_predictions_fails_at_the_first_step(tmp_path):
    binary = [a for a in EXAMPLE if "train.metrics" not in a]
    binary.append("+train.metrics.f1._target_=torchmetrics.classification.BinaryF1Score")  # (N, 2) logits: not binary
    result = run_launcher(*binary, run_dir=tmp_path)
    assert result.returncode == 1
    said = "train.metrics.f1 does not take this model's predictions ((16, 2) float32) and targets ((16,) int64): "
    assert said in result.stderr and "HINT: a metric for these shapes" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists() or "eval" not in (tmp_path / "metrics.jsonl").read_text()
