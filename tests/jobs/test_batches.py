"""Issue 48: any batch a user's Dataset makes (tuples, dicts, nested dicts, dataclasses) trains on 2 real ranks
exactly as tuples train in one process; a metric that is not a mean (F1) is computed over the whole evaluation and
equals torchmetrics' own value on the whole test set (not the mean over batches, which differs), reported under
its name; what does not fit is named at the first step with the key."""

import json

import pytest
import torch
from torchmetrics.functional.classification import multiclass_f1_score

from harness import REPO
from harness.ranks import train_layout
from harness.run import run_launcher
from harness.structured import CLASSES, Net, samples

NET = ("model._target_=harness.structured.Net",)  # (it takes the default model's arguments too)
F1 = (
    "+train.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
    f"+train.metrics.f1.num_classes={CLASSES}",
    "+train.metrics.f1.average=macro",
    "+train.metrics.batch_f1=harness.structured.batch_f1",
)


def data(kind):
    return ("data._target_=harness.structured.samples", f"+data.kwargs.kind={kind}", "train.batch_size=32")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train_layout(tmp_path_factory.mktemp("one"), "1x1", *NET, *data("tuple"), "train.epochs=2")


@pytest.mark.parametrize("kind", ["dict", "nested", "dataclass"])
def test_each_batch_structure_on_two_ranks_trains_what_tuples_train_in_one_process(tmp_path, kind, one_process):
    two = train_layout(tmp_path, "1x2", *NET, *data(kind), "train.epochs=2")
    for name, value in two[0]["params"].items():
        torch.testing.assert_close(value, one_process[0]["params"][name], rtol=1e-4, atol=1e-5)
    assert two[0]["summary"]["steps"] == one_process[0]["summary"]["steps"] == 16


def test_f1_is_the_whole_evaluations_not_a_mean_of_batches(tmp_path):
    two = train_layout(tmp_path, "1x2", *NET, *data("dict"), *F1, "train.epochs=2", "+data.kwargs.test=600")
    model = Net(hidden=two[0]["params"]["body.0.weight"].shape[0])  # (model=mlp's arguments)
    model.load_state_dict(two[0]["params"])
    _, test = samples("dict", test=600)  # 300 a rank: batches of 256 and 44
    with torch.no_grad():
        logits = model(x=test.x)
    whole = float(multiclass_f1_score(logits, test.y, num_classes=CLASSES, average="macro"))
    metrics = two[0]["summary"]["test_metrics"]
    assert metrics["f1"] == pytest.approx(whole, abs=1e-6), metrics
    assert abs(metrics["batch_f1"] - whole) > 1e-3, metrics  # the mean of batch values: not the F1 of the set
    assert set(metrics) == {"accuracy", "f1", "batch_f1"}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert {"test_f1", "test_batch_f1", "test_accuracy", "test_loss"} <= set(evals[-1]), evals[-1]


def test_a_dict_sample_without_its_labels_key_is_refused_at_the_first_step(tmp_path):
    tests = {"PYTHONPATH": str(REPO / "tests")}  # harness.structured, for the head and the ranks
    args = (*NET, *data("dict"), "train.labels_key=target", "train.max_steps=3")
    result = run_launcher(*args, run_dir=tmp_path, env=tests)
    assert result.returncode == 1
    said = "a dict batch without the labels key 'target' (its keys: 'x', 'labels'), but train.loss=cross_entropy"
    assert said in result.stderr and "HINT: train.labels_key=<the key of the targets>" in result.stderr, result.stderr
