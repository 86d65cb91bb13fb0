"""Issue 48: any batch a user's Dataset makes (tuples, dicts, nested dicts, dataclasses) trains on 2 real ranks
exactly as tuples train in one process; a metric that is not a mean (F1) is computed over the whole evaluation and
equals torchmetrics' own value on the whole test set (not the mean over batches, which differs), reported under
its name; the evaluation counts each held-out sample once, on 3 ranks and a test set they do not divide (where a
DistributedSampler would pad it with repeats): its F1, accuracy and mean loss are the whole set's, a count of the
samples it saw the set's size; what does not fit is named at the first step with the key."""

import json

import pytest
import torch
from torch.utils.data import TensorDataset
from torchmetrics import Metric
from torchmetrics.functional.classification import multiclass_f1_score

from harness import REPO
from harness.ranks import train_layout
from harness.run import run_launcher
from harness.structured import CLASSES, Net, samples
from launcher.train.data import eval_loader

NET = ("model._target_=harness.structured.Net",)  # (it takes the default model's arguments too)
F1 = (
    "+train.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
    f"+train.metrics.f1.num_classes={CLASSES}",
    "+train.metrics.f1.average=macro",
    "+train.metrics.batch_f1=harness.structured.batch_f1",
)


def data(kind, batch=32):
    return ("data._target_=harness.structured.samples", f"+data.kwargs.kind={kind}", f"train.batch_size={batch}")


class Seen(Metric):
    """How many held-out samples an evaluation saw, every rank's (a sum, synchronised by torchmetrics): a metric of
    ``train.metrics`` (``test_batches.Seen``, imported by the ranks as their module)."""

    samples: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("samples", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        self.samples += targets.shape[0]

    def compute(self) -> torch.Tensor:
        return self.samples


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train_layout(tmp_path_factory.mktemp("one"), "1x1", *NET, *data("tuple"), "train.epochs=2")


@pytest.mark.parametrize("kind", ["dict", "nested", "dataclass"])
def test_each_batch_structure_on_two_ranks_trains_what_tuples_train_in_one_process(tmp_path, kind, one_process):
    two = train_layout(tmp_path, "1x2", *NET, *data(kind), "train.epochs=2")
    for name, value in two[0]["params"].items():
        torch.testing.assert_close(value, one_process[0]["params"][name], rtol=1e-4, atol=1e-5)
    assert two[0]["summary"]["steps"] == one_process[0]["summary"]["steps"] == 16


TEST = 37  # held-out samples: 13, 12 and 12 a rank, one batch each (a DistributedSampler pads to 39)


def test_f1_is_the_whole_evaluations_not_a_mean_of_batches(tmp_path):
    """On 3 ranks and a held-out split they do not divide: F1, accuracy and the mean loss are the whole split's,
    each sample counted once (no repeat, none left out: a count of the samples the evaluation saw)."""
    seen = ("+train.metrics.seen._target_=test_batches.Seen",)
    three = train_layout(
        tmp_path, "3x1", *NET, *data("dict", 30), *F1, *seen, "train.epochs=2", f"+data.kwargs.test={TEST}"
    )
    model = Net(hidden=three[0]["params"]["body.0.weight"].shape[0])  # (model=mlp's arguments)
    model.load_state_dict(three[0]["params"])
    _, test = samples("dict", test=TEST)
    with torch.no_grad():
        logits = model(x=test.x)
    whole = float(multiclass_f1_score(logits, test.y, num_classes=CLASSES, average="macro"))
    metrics = three[0]["summary"]["test_metrics"]
    assert metrics["seen"] == TEST, metrics  # each sample once: none twice, none left out
    assert metrics["f1"] == pytest.approx(whole, abs=1e-6), metrics
    assert abs(metrics["batch_f1"] - whole) > 1e-3, metrics  # the mean of batch values: not the F1 of the set
    right = float((logits.argmax(-1) == test.y).double().mean())
    assert metrics["accuracy"] == pytest.approx(right, abs=1e-9), (metrics, right)
    loss = float(torch.nn.functional.cross_entropy(logits, test.y))
    assert three[0]["summary"]["test_loss"] == pytest.approx(loss, abs=1e-5), (three[0]["summary"], loss)
    assert set(metrics) == {"accuracy", "f1", "batch_f1", "seen"}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert {"test_f1", "test_batch_f1", "test_accuracy", "test_loss"} <= set(evals[-1]), evals[-1]
    assert evals and all(r["test_seen"] == TEST for r in evals), evals  # (every evaluation)


@pytest.mark.parametrize("size", [1001, 7, 2])
def test_the_eval_loader_gives_each_sample_to_one_rank_once(size):
    """3 ranks' shares of a split they do not divide (or smaller than them): every index once, none repeated."""
    split = TensorDataset(torch.arange(size))
    loaders = [eval_loader(split, 256, rank, 3) for rank in range(3)]
    shares = [[int(i) for (batch,) in loader or () for i in batch] for loader in loaders]
    assert sorted(i for share in shares for i in share) == list(range(size)), shares
    assert max(map(len, shares)) - min(map(len, shares)) <= 1, [len(s) for s in shares]


def test_a_dict_sample_without_its_labels_key_is_refused_at_the_first_step(tmp_path):
    tests = {"PYTHONPATH": str(REPO / "tests")}  # harness.structured, for the head and the ranks
    args = (*NET, *data("dict"), "train.labels_key=target", "train.max_steps=3")
    result = run_launcher(*args, run_dir=tmp_path, env=tests)
    assert result.returncode == 1
    said = "a dict batch without the labels key 'target' (its keys: 'x', 'labels'), but train.loss=cross_entropy"
    assert said in result.stderr and "HINT: train.labels_key=<the key of the targets>" in result.stderr, result.stderr
