"""What a batch is to the trainer: any structure of tensors a Dataset's samples make, collated as a whole (a
tensor, a tuple or list, a dict, nested, a dataclass), moved to the rank's device as a whole, and split into what the
model is called with and the targets:

- a dict (or a dataclass, read as the dict of its fields): ``model(**batch)`` without the labels key
  (``train.labels_key``, default ``labels``), whose value is the targets; under ``train.loss=model`` the model gets
  the labels too (``model(**batch)``: Hugging Face models compute their loss from ``labels``);
- a tuple or list: the last element is the targets, the others the model's arguments (``model(x)``; ``model(x, y)``
  under ``train.loss=model``);
- a tensor alone: the model's input, no targets (``train.loss=model`` only).

Predictions for the metrics are the model's output tensor, or its ``logits`` (attribute or key). What does not fit
(a dict without the labels key, a leaf that is not a tensor) is named at the first step with the key and the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.data import default_collate


class BatchError(TypeError):
    """A batch the trainer cannot use: says which key holds what, and the fix."""


def collate(samples: list[Any]) -> Any:
    """A DataLoader's ``collate_fn``: torch's ``default_collate``, and dataclasses (field by field) at any depth."""
    first = samples[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = {f.name: collate([getattr(s, f.name) for s in samples]) for f in dataclasses.fields(first)}
        return type(first)(**fields)
    if isinstance(first, Mapping):
        return {key: collate([s[key] for s in samples]) for key in first}
    if isinstance(first, (tuple, list)) and not hasattr(first, "_fields"):
        return [collate(list(column)) for column in zip(*samples)]
    return default_collate(samples)


def as_tree(batch: Any) -> Any:
    """A dataclass batch as the dict of its fields (at any depth); the rest as it is."""
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return {f.name: as_tree(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    if isinstance(batch, Mapping):
        return {key: as_tree(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return [as_tree(value) for value in batch]
    return batch


def to_device(batch: Any, device: torch.device, where: str = "batch") -> Any:
    """Every tensor of ``batch`` on ``device`` (non-blocking: pinned host memory copies asynchronously); a leaf
    that is not a tensor is named with its key."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device, f"{where}[{key!r}]") for key, value in batch.items()}
    if isinstance(batch, (tuple, list)) and not (batch and isinstance(batch[0], (str, bytes))):
        return [to_device(value, device, f"{where}[{i}]") for i, value in enumerate(batch)]
    kind = f"a {type(batch).__name__}"
    if isinstance(batch, Sequence) and batch and not isinstance(batch, (str, bytes)):
        kind = f"a {type(batch).__name__} of {type(batch[0]).__name__}"
    raise BatchError(
        f"{where} holds {kind}, not a tensor; HINT: make the Dataset return tensors (token ids, not text: tokenize "
        "in the Dataset), numbers become tensors when batched"
    )


@dataclass(frozen=True)
class Batch:
    """One batch, split: ``inputs`` (a dict: the model's keywords; a list: its arguments; else its one argument),
    ``targets`` (None: none), ``whole`` (what ``train.loss=model`` calls the model with: the labels too)."""

    inputs: Any
    targets: Optional[torch.Tensor]
    whole: Any

    @property
    def size(self) -> int:
        """The samples in the batch (the first dimension of the targets, else of the first tensor)."""
        if self.targets is not None:
            return int(self.targets.shape[0])
        return int(_first_tensor(self.inputs).shape[0])

    def chunk(self, n: int) -> list[Batch]:
        """``n`` micro-batches along the first dimension of every tensor (``train.accumulate_steps``)."""
        return [
            Batch(*parts)
            for parts in zip(chunk_tree(self.inputs, n), chunk_tree(self.targets, n), chunk_tree(self.whole, n))
        ]


def split(batch: Any, labels_key: str) -> Batch:
    """``batch`` (on its device) into the model's inputs and the targets (the module's rules)."""
    if isinstance(batch, Mapping):
        keywords = {key: value for key, value in batch.items() if key != labels_key}
        return Batch(keywords, batch.get(labels_key), dict(batch))
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        arguments = batch[0] if len(batch) == 2 else list(batch[:-1])
        return Batch(arguments, batch[-1], list(batch))
    if isinstance(batch, (tuple, list)):
        return Batch(batch[0], None, batch[0])
    return Batch(batch, None, batch)


def call(model: torch.nn.Module, inputs: Any) -> Any:
    """The model on ``inputs``: keywords for a dict, arguments for a list, else one argument."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, list):
        return model(*inputs)
    return model(inputs)


def need_targets(batch: Batch, labels_key: str, why: str) -> torch.Tensor:
    """The targets, or the error naming what the batch holds."""
    if isinstance(batch.targets, torch.Tensor):
        return batch.targets
    if isinstance(batch.whole, Mapping):
        keys = ", ".join(map(repr, batch.whole))
        raise BatchError(
            f"a dict batch without the labels key {labels_key!r} (its keys: {keys}), but {why} needs targets; HINT: "
            "train.labels_key=<the key of the targets>, or train.loss=model (the model computes its loss)"
        )
    raise BatchError(
        f"a batch of {value_words(batch.whole)} has no targets, but {why} needs them; HINT: samples (inputs, target), "
        "a dict with the labels key (train.labels_key), or train.loss=model"
    )


def predictions(outputs: Any, why: str) -> torch.Tensor:
    """What the metrics score: the output tensor, or its ``logits`` (attribute or key)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise BatchError(
        f"the model returned {value_words(outputs)}, neither a tensor nor an object or dict with 'logits', but {why} "
        "needs predictions; HINT: return the logits, or an output with .logits (the Hugging Face convention)"
    )


def value_words(value: Any) -> str:
    """A value as an error names it: ``a (4, 5) float32 tensor``, ``a tuple``."""
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} tensor"
    return f"a {type(value).__name__}"


def _first_tensor(tree: Any) -> torch.Tensor:
    if isinstance(tree, torch.Tensor):
        return tree
    values = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (tuple, list)) else ()
    for value in values:
        try:
            return _first_tensor(value)
        except BatchError:
            continue
    raise BatchError(f"a batch of {value_words(tree)} holds no tensor")


def chunk_tree(tree: Any, n: int) -> list[Any]:
    """``n`` equal parts of every tensor of ``tree`` along its first dimension (a micro-batch each)."""
    if isinstance(tree, torch.Tensor):
        parts = list(tree.chunk(n))
        if len(parts) != n:
            raise BatchError(f"a batch of {tree.shape[0]} samples does not split into {n} micro-batches")
        return parts
    if isinstance(tree, Mapping):
        columns = {key: chunk_tree(value, n) for key, value in tree.items()}
        return [{key: parts[i] for key, parts in columns.items()} for i in range(n)]
    if isinstance(tree, (tuple, list)):
        columns_ = [chunk_tree(value, n) for value in tree]
        return [[parts[i] for parts in columns_] for i in range(n)]
    return [tree] * n
