"""Issue 48: a real Hugging Face model (``transformers``' BERT built from a small config: ``models/hf_bert.py``,
nothing downloaded) trains through the trainer on 2 gloo ranks with dict batches (``model(**batch)``, the labels
too under ``train.loss=model``, its ``SequenceClassifierOutput``'s ``loss`` minimised and ``logits`` scored) exactly
as one process trains on the whole batch, with a torchmetrics F1 reported under its name."""

import os

import pytest
import torch

from harness.ranks import train_layout
from launcher.base.run_dir import RunDir
from launcher.commands.plot import load_metrics

BERT = (
    "model=text_classifier",  # its arguments (vocab and length from the data), another class
    "model._target_=models.hf_bert.bert_classifier",
    "model.d_model=32",
    "model.heads=2",
    "model.layers=1",
    "data=text_classification",
    "data.kwargs.train_samples=256",
    "data.kwargs.test_samples=128",
    "train.loss=model",
    "+train.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
    "+train.metrics.f1.num_classes=2",
    "train.batch_size=32",  # the global batch: 16 a rank on 2 ranks, 32 in one process
    "train.max_steps=48",  # 8 steps an epoch: 6 epochs (about a second of training)
    "train.log_every_steps=8",
    "optim.name=adamw",
    "optim.lr=0.01",
)


@pytest.fixture
def hugging_face(tmp_path, monkeypatch):
    """transformers, or the test is skipped saying how to get it (in the test's setup, not at collection: under
    LAUNCHER_REQUIRE_BEDS=1, as in CI, which installs the test extra, the skip fails: tests/conftest.py). Nothing is
    downloaded; were anything written to a Hugging Face cache, it would be under tmp_path (removed when the test
    passes), not ~/.cache/huggingface: the ranks take the test's environment (``spawn_ranks``)."""
    pytest.importorskip(
        "transformers",
        reason="the transformers package is not installed; HINT: the test extra brings it: pip install -e '.[test]' "
        "(scripts/env.sh does; CI has it)",
    )
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_bert_on_two_ranks_trains_what_one_process_trains_on_the_whole_batch(tmp_path, hugging_face):
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    one = train_layout(tmp_path / "one", "1x1", *BERT)
    two = train_layout(tmp_path / "two", "1x2", *BERT)
    assert two[0]["summary"]["steps"] == one[0]["summary"]["steps"] == 48
    params = two[0]["params"]
    assert "bert.embeddings.word_embeddings.weight" in params and "classifier.weight" in params, list(params)
    for name, value in params.items():
        torch.testing.assert_close(value, two[1]["params"][name], rtol=0, atol=0)  # the ranks agree exactly
        if name.endswith("attention.self.key.bias"):
            # softmax ignores what the key bias adds (the same q.b for every key): its gradient is 0 but for
            # rounding, which AdamW scales up to steps of ~lr/10 either way; it starts at 0 and stays inert noise
            assert value.abs().max() < 0.01 and one[0]["params"][name].abs().max() < 0.01, name
            continue
        torch.testing.assert_close(
            value, one[0]["params"][name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )

    trained, evals = load_metrics(RunDir(tmp_path / "two" / "run"))
    assert trained[-1]["loss"] < 0.85 * trained[0]["loss"], [t["loss"] for t in trained]  # it learns (0.68 to 0.53)
    one_trained, one_evals = load_metrics(RunDir(tmp_path / "one" / "run"))
    assert [t["loss"] for t in trained] == pytest.approx([t["loss"] for t in one_trained], rel=1e-4)

    for summary in (two[0]["summary"], one[0]["summary"]):
        assert set(summary["test_metrics"]) == {"f1"}, summary["test_metrics"]  # no "accuracy": the model's loss
        assert summary["test_accuracy"] is None and summary["loss"] == "model"
        assert 0.0 <= summary["test_metrics"]["f1"] <= 1.0
    # one process evaluates the 128 test samples in one batch: torchmetrics' F1 of the whole set, which the 2 ranks'
    # halves, synchronised by torchmetrics, give too (at every evaluation)
    assert [e["test_f1"] for e in evals] == pytest.approx([e["test_f1"] for e in one_evals], abs=1e-6)
    assert two[0]["summary"]["test_metrics"]["f1"] == pytest.approx(one[0]["summary"]["test_metrics"]["f1"], abs=1e-6)
    assert {"test_f1", "test_loss"} <= set(evals[-1]) and "test_accuracy" not in evals[-1], evals[-1]
    assert [e["test_loss"] for e in evals] == pytest.approx([e["test_loss"] for e in one_evals], rel=1e-4)
    assert not os.path.exists(tmp_path / "hf-home"), (
        "transformers wrote a cache: a model built from a config should not"
    )
