"""Issue 48: what a batch holds that the trainer cannot use is named at the first step with its key and the fix (a
dict without the labels key, a leaf that is not a tensor, a model output with neither a tensor nor logits for a
metric); structures split as the docs say."""

from dataclasses import dataclass

import pytest
import torch

from launcher.train.batch import BatchError, as_tree, collate, need_targets, predictions, split, to_device

CPU = torch.device("cpu")


def test_a_dict_without_the_labels_key_names_its_keys_and_the_fix():
    batch = split({"input_ids": torch.zeros(2, 3), "label": torch.zeros(2)}, "labels")
    with pytest.raises(BatchError) as error:
        need_targets(batch, "labels", "train.loss=cross_entropy")
    assert str(error.value) == (
        "a dict batch without the labels key 'labels' (its keys: 'input_ids', 'label'), but train.loss=cross_entropy "
        "needs targets; HINT: train.labels_key=<the key of the targets>, or train.loss=model (the model computes its "
        "loss)"
    )


def test_a_leaf_that_is_not_a_tensor_is_named_with_its_key():
    raw = collate([{"text": "a b", "labels": 0}, {"text": "c", "labels": 1}])
    with pytest.raises(BatchError) as error:
        to_device(raw, CPU)
    assert str(error.value).startswith("batch['text'] holds a list of str, not a tensor; HINT: make the Dataset return")


def test_an_output_without_a_tensor_or_logits_is_named_for_the_metrics():
    with pytest.raises(BatchError, match=r"the model returned a tuple, neither a tensor nor an object or dict with"):
        predictions((torch.zeros(2), torch.zeros(2)), "train.metrics (f1)")
    assert predictions({"logits": torch.ones(1)}, "x").item() == 1.0


@dataclass
class Pair:
    x: torch.Tensor
    labels: torch.Tensor


def test_structures_split_into_the_models_inputs_and_the_targets():
    samples = [Pair(torch.full((2,), float(i)), torch.tensor(i)) for i in range(4)]
    batch = split(to_device(as_tree(collate(samples)), CPU), "labels")
    assert batch.inputs.keys() == {"x"} and batch.targets.tolist() == [0, 1, 2, 3] and batch.size == 4
    assert batch.whole.keys() == {"x", "labels"}  # train.loss=model: the labels too
    micro = batch.chunk(2)
    assert [m.targets.tolist() for m in micro] == [[0, 1], [2, 3]] and micro[1].inputs["x"][0, 0] == 2.0
    three = split([torch.zeros(4, 1), torch.ones(4, 1), torch.arange(4)], "labels")
    assert isinstance(three.inputs, list) and len(three.inputs) == 2 and three.targets.tolist() == [0, 1, 2, 3]
