"""Any task in the built-in trainer (issue 36): a language model with per-token targets (``models/charlm.py``, the
docs' example, docs/configuration.md) trains through the launcher with cross-entropy on its logits, with its own loss
(``train.loss=model``: forward(inputs, targets) returns an object with ``.loss``) and with a loss function
(``train.loss=pkg.fn``); what does not fit is named at step 1. (N ranks following one process on the same global
batches: tests/jobs/test_parity.py and the others; an embedding's gradient is dense, reduced as any other.)"""

import json

import pytest
import torch

from harness.checks import final_state
from harness.run import run_launcher
from launcher.train.batch import Batch
from launcher.train.task import Task, TaskError

LM = ("model._target_=models.charlm.CharGRU", "data._target_=models.charlm.text_data", "train.batch_size=32")
SHORT = ("train.max_steps=12", "train.checkpoint_every_steps=12", "train.log_every_steps=4")


def train_lines(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("kind") == "train"], [r for r in lines if r.get("kind") == "eval"]


def test_bf16_accumulation_clipping_and_a_resume_with_the_models_own_loss(tmp_path):
    run_dir = tmp_path / "run"
    own = ("+model.own_loss=true", "train.loss=model", "train.metric=models.charlm.token_accuracy")
    extra = ("train.precision=bf16", "train.accumulate_steps=2", "optim.clip_grad_norm=1.0", "cluster.procs_per_node=2")
    first = run_launcher(*LM, *own, *extra, "train.max_steps=8", "train.checkpoint_every_steps=4", run_dir=run_dir)
    assert first.returncode == 0, first.stderr
    again = run_launcher(*LM, *own, *extra, *SHORT, run_dir=run_dir)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr
    assert "the LR schedule spans 12 steps now, 8 in the run that wrote" in again.stderr  # (no schedule_steps given)
    trained, evaluated = train_lines(run_dir)
    assert all(r["grad_norm"] > 0 for r in trained)  # logged with clipping
    assert evaluated[-1]["test_token_accuracy"] > 0.15  # the older train.metric: a function, under its name
    assert "test_accuracy" not in evaluated[-1]  # no accuracy where none was computed (train.loss=model)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["precision"], summary["accumulate_steps"], summary["clip_grad_norm"]) == ("bf16", 2, 1.0)
    assert summary["loss"] == "model" and summary["steps"] == 12


DOUBLED = """import torch.nn.functional as F


def doubled(logits, targets):
    return 2 * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
"""


def test_a_loss_function_of_ones_own(tmp_path):
    """``train.loss=pkg.fn`` is what the trainer minimises and logs: a loss of one's own that is not cross-entropy
    (twice cross-entropy, from a module of the user's on PYTHONPATH) trains, logs its own values, and ends in another
    model than cross-entropy's run on the same batches (its gradients are twice as large)."""
    (tmp_path / "my_losses.py").write_text(DOUBLED)
    own, plain = tmp_path / "own", tmp_path / "cross-entropy"
    for run_dir, loss in ((own, "my_losses.doubled"), (plain, "cross_entropy")):
        given = (f"train.loss={loss}", "cluster.procs_per_node=2")
        result = run_launcher(*LM, *SHORT, *given, run_dir=run_dir, env={"PYTHONPATH": str(tmp_path)})
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("test accuracy" in result.stderr) == (loss == "cross_entropy")  # no metric given: the loss only
    trained, evaluated = train_lines(own)
    assert trained[-1]["loss"] < trained[0]["loss"] - 0.6
    assert [k for k in evaluated[-1] if k.startswith("test_")] == ["test_loss"]
    baseline, _ = train_lines(plain)
    assert [r["step"] for r in trained] == [r["step"] for r in baseline]
    assert all(1.5 < a["loss"] / b["loss"] < 2.5 for a, b in zip(trained, baseline)), (trained, baseline)
    ours, theirs = final_state(own)["model"], final_state(plain)["model"]
    assert any(not torch.allclose(ours[name], theirs[name], rtol=1e-3, atol=1e-4) for name in ours)


def test_a_model_returning_an_output_with_logits_trains_with_cross_entropy(tmp_path):
    """The Hugging Face shape (an output object with .logits) under train.loss=cross_entropy: its logits are used."""
    result = run_launcher(*LM, "+model.own_loss=true", *SHORT, run_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    accuracy = train_lines(tmp_path)[1][-1]["test_accuracy"]  # per token: 256 test sequences x 32 positions
    assert accuracy is not None and 0.15 < accuracy <= 1, accuracy
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["loss"] == "cross_entropy" and summary["test_accuracy"] == accuracy, summary


LOGITS = torch.zeros(4, 5, 7)


@pytest.mark.parametrize(
    ("outputs", "targets", "said"),
    [
        (
            (LOGITS, LOGITS),
            torch.zeros(4, 5, dtype=torch.int64),
            "the model returned a tuple, neither a tensor nor an object or dict with 'logits', but train.loss=",
        ),
        (LOGITS, torch.zeros(4, 5), "needs integer class labels; the data gives a (4, 5) float32 tensor"),
        (
            LOGITS,
            torch.zeros(4, 6, dtype=torch.int64),
            "outputs are a (4, 5, 7) float32 tensor and the labels a (4, 6)",
        ),
    ],
    ids=["tuple", "float-labels", "shapes"],
)
def test_what_does_not_fit_cross_entropy_is_named(outputs, targets, said):
    with pytest.raises(TaskError, match="HINT") as error:
        Task("cross_entropy").loss(outputs, Batch(None, targets, None))
    assert said in str(error.value)


def test_the_models_own_loss_must_be_there():
    batch = Batch(None, torch.zeros(1), None)
    assert Task("model").loss({"loss": torch.tensor(2.0)}, batch) == 2.0
    with pytest.raises(TaskError, match="returned a dict without a one-element loss"):
        Task("model").loss({"logits": LOGITS}, batch)
    with pytest.raises(TaskError, match=r"returned a dict whose loss is None \(a Hugging Face model computes it only"):
        Task("model").loss({"loss": None, "logits": LOGITS}, batch)


def test_max_steps_within_an_epoch_is_reported_as_run(tmp_path):
    """train.max_steps=6 of 22 steps per epoch: the banner said "6 steps (10 epoch(s) of 22)", the end "0 epoch(s)",
    the LR schedule spanned the 10 epochs (it barely decayed); the run ends with an evaluation."""
    result = run_launcher("train.max_steps=6", "train.log_every_steps=3", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "6 steps (0.27 of an epoch of 22); lr cosine to 0 over 6 steps" in result.stderr
    assert "done: 6 steps, 0.27 of an epoch of 22 on 2 rank(s)" in result.stderr
    trained, evaluated = train_lines(tmp_path)
    assert trained[-1]["step"] == 6
    # cosine from 0.1 to 0 over the 6 steps: half way at step 3
    assert trained[0]["lr"] == pytest.approx(0.05) and trained[-1]["lr"] < 1e-9, trained
    assert len(evaluated) == 1 and evaluated[0]["step"] == 6  # the evaluation at the end
