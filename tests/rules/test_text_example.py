"""The text example users copy (``models/text_classifier.py``, ``models/text_data.py``, ``model=text_classifier
data=text_classification``): the generated data set is deterministic, made of dicts of tensors with the documented
keys and dtypes, both classes present and imbalanced (F1 differs from accuracy); the model takes a collated batch by
keyword and returns loss and logits, readable as attributes and keys, without a loss when there are no labels."""

import pytest
import torch
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from harness.config import compose
from models.text_classifier import ClassifierOutput, TextClassifier
from models.text_data import text_classification

SMALL = dict(train_samples=96, test_samples=32, vocab_size=40, seq_len=16)


def f1_and_accuracy(predicted: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    tp = int(((predicted == 1) & (labels == 1)).sum())
    wrong = int((predicted != labels).sum())
    return 2 * tp / max(2 * tp + wrong, 1), 1 - wrong / len(labels)


def test_the_data_set_is_the_same_from_the_same_seed_and_differs_across_seeds():
    (a, a_test), (b, b_test) = text_classification(**SMALL, seed=3), text_classification(**SMALL, seed=3)
    for x, y in ((a, b), (a_test, b_test)):
        assert len(x) == len(y)
        assert all(torch.equal(x[i][k], y[i][k]) for i in range(len(x)) for k in x[i])
    other, _ = text_classification(**SMALL, seed=4)
    assert not torch.equal(other[0]["input_ids"], a[0]["input_ids"])
    assert not any(torch.equal(a[i]["input_ids"], a_test[0]["input_ids"]) for i in range(len(a)))  # disjoint draws


def test_items_are_dicts_of_tensors_with_the_documented_keys_dtypes_and_padding():
    train, test = text_classification(**SMALL)
    assert (len(train), len(test)) == (96, 32)
    lengths = set()
    for dataset in (train, test):
        for i in range(len(dataset)):
            item = dataset[i]
            assert set(item) == {"input_ids", "attention_mask", "labels"}
            ids, mask, label = item["input_ids"], item["attention_mask"], item["labels"]
            assert ids.dtype == mask.dtype == label.dtype == torch.int64
            assert ids.shape == mask.shape == (16,) and label.shape == ()
            real = int(mask.sum())
            assert 16 // 4 <= real <= 16 and torch.equal(mask[:real], torch.ones(real, dtype=torch.int64))
            assert not mask[real:].any() and not ids[real:].any()  # padded on the right with 0s
            assert ids[:real].min() >= 1 and ids[:real].max() < 40
            lengths.add(real)
    assert len(lengths) > 3  # padding varies per sample


def test_both_classes_are_present_imbalanced_so_f1_differs_from_accuracy():
    train, test = text_classification()
    for dataset in (train, test):
        labels = dataset.labels
        assert set(labels.tolist()) == {0, 1}
        assert 0.2 < labels.float().mean() < 0.45
        for trivial in (torch.zeros_like(labels), torch.ones_like(labels)):
            f1, accuracy = f1_and_accuracy(trivial, labels)
            assert abs(f1 - accuracy) > 0.1, (f1, accuracy)


def test_the_forward_on_a_collated_batch_returns_loss_and_logits():
    train, _ = text_classification(**SMALL)
    batch = next(iter(DataLoader(train, batch_size=8)))  # the default collation: a dict of stacked tensors
    assert batch["input_ids"].shape == (8, 16) and batch["labels"].shape == (8,)
    torch.manual_seed(0)
    model = TextClassifier(vocab_size=40, num_classes=2, d_model=32, heads=2, layers=1, max_len=16)
    out = model(**batch)
    assert isinstance(out, ClassifierOutput)
    assert out.logits.shape == (8, 2) and out.loss.shape == () and torch.isfinite(out.loss)
    assert out["loss"] is out.loss and out["logits"] is out.logits and set(out) == {"logits", "loss"}
    assert torch.allclose(out.loss, torch.nn.functional.cross_entropy(out.logits, batch["labels"]))
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())

    unlabelled = {k: v for k, v in batch.items() if k != "labels"}
    bare = model(**unlabelled)
    assert bare.loss is None and "loss" not in bare and dict(bare).keys() == {"logits"}
    assert torch.equal(bare["logits"], out.logits)
    with pytest.raises(KeyError):
        bare["loss"]


def test_padding_does_not_change_a_sentence_s_logits():
    model = TextClassifier(vocab_size=40, d_model=32, heads=2, layers=2, max_len=16).eval()
    ids = torch.tensor([[5, 9, 3, 7, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        padded = model(ids, mask).logits
        longer = model(torch.cat([ids, torch.zeros(1, 8, dtype=torch.int64)], 1), torch.cat([mask, mask * 0], 1))
        alone = model(ids[:, :4]).logits
    assert torch.allclose(padded, alone, atol=1e-5) and torch.allclose(longer.logits, alone, atol=1e-5)


def test_the_default_size_and_its_limits():
    assert 100_000 <= sum(p.numel() for p in TextClassifier().parameters()) <= 400_000
    with pytest.raises(ValueError, match="max_len=8"):
        TextClassifier(max_len=8)(torch.ones(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="heads=3"):
        TextClassifier(d_model=64, heads=3)


def test_the_config_groups_build_the_model_for_the_data():
    config = compose("model=text_classifier", "data=text_classification")
    data = OmegaConf.to_container(config.data, resolve=True)
    train, test = get_method(data["_target_"])(**data["kwargs"])
    model = instantiate(config.model)
    assert isinstance(model, TextClassifier) and model.max_len == data["kwargs"]["seq_len"]
    assert model.tokens.num_embeddings == data["kwargs"]["vocab_size"] and model.head.out_features == 2
    batch = next(iter(DataLoader(test, batch_size=4)))
    assert model(**batch).logits.shape == (4, data["num_classes"])
