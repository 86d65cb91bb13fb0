"""What the built-in trainer minimises and reports, for any task (``train.loss``; batches: ``batch.py``):

- ``cross_entropy`` (default): the model's output (a tensor, or its ``logits``) has the classes last, (N, C) for one
  label per sample or (N, ..., C) for a label per position (a language model's per-token targets, (N, ...)); the
  loss is the mean over every label, the accuracy the share of labels right.
- ``model``: the model gets the whole batch, targets included (``model(x, y)``; a dict: ``model(**batch)``, the
  labels too: the Hugging Face convention) and returns the loss itself, or an object or dict with ``loss``.
- ``pkg.module.fn``: ``fn(outputs, targets) -> loss`` on the model's output (mean over the batch).

Evaluation reports the loss as the mean over every evaluated sample (every label, for cross-entropy), the accuracy
under cross-entropy, and ``train.metrics`` (``scores.py``). What does not fit (a tuple from the model, float labels for
cross-entropy, shapes that do not line up, a missing labels key) is named at the first step with the value, the
expectation and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import get_method
from torch import nn

from launcher.train.batch import Batch, BatchError, call, need_targets, predictions, value_words

BUILT_IN = ("cross_entropy", "model")


class TaskError(TypeError):
    """The model's outputs or the data's targets do not fit ``train.loss``: says which, and the fix."""


class Task:
    def __init__(self, loss: str = "cross_entropy", labels_key: str = "labels") -> None:
        self.kind = loss if loss in BUILT_IN else "callable"
        self.loss_fn = None if loss in BUILT_IN else get_method(loss)
        self.name, self.labels_key = loss, labels_key

    @property
    def has_accuracy(self) -> bool:
        return self.kind == "cross_entropy"

    def outputs(self, model: nn.Module, batch: Batch) -> Any:
        """The model on the batch: its inputs (without the targets), or everything under ``train.loss=model``; a batch
        without the targets the loss needs is named before the model sees it."""
        if self.kind == "model":
            return call(model, batch.whole)
        need_targets(batch, self.labels_key, f"train.loss={self.name}")
        return call(model, batch.inputs)

    def loss(self, outputs: Any, batch: Batch) -> torch.Tensor:
        """The batch's mean loss (a scalar tensor)."""
        if self.kind == "model":
            return _model_loss(outputs)
        logits, y = self._logits(outputs), need_targets(batch, self.labels_key, f"train.loss={self.name}")
        if self.kind == "cross_entropy":
            flat, labels = _flat(logits, y)
            return F.cross_entropy(flat, labels)
        loss = self.loss_fn(logits, y)  # type: ignore[misc]
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise TaskError(f"train.loss={self.name} returned {value_words(loss)}, not a one-element loss tensor")
        return loss.reshape(())

    def eval_sums(self, outputs: Any, batch: Batch) -> torch.Tensor:
        """(loss sum, loss count, right, count) of one held-out batch, in float64: the loss summed over the samples
        (cross-entropy: over the labels), and cross-entropy's labels right (zeros for the others)."""
        if self.kind == "cross_entropy":
            y = need_targets(batch, self.labels_key, f"train.loss={self.name}")
            flat, labels = _flat(self._logits(outputs), y)
            right = (flat.argmax(-1) == labels).sum().double()
            count = _f64(labels.numel(), flat)
            loss_sum = F.cross_entropy(flat.float(), labels, reduction="sum").double()
            return torch.stack([loss_sum, count, right, count])
        loss = self.loss(outputs, batch).double()
        n = _f64(batch.size, loss)
        return torch.stack([loss * n, n, _f64(0.0, loss), _f64(0.0, loss)])

    def _logits(self, outputs: Any) -> torch.Tensor:
        try:
            return predictions(outputs, f"train.loss={self.name}")
        except BatchError as exc:
            hint = "; or compute the loss in the model: train.loss=model (an output with .loss)"
            raise TaskError(f"{exc}{hint}") from None


def _f64(value: Any, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=like.device).reshape(())


def _model_loss(outputs: Any) -> torch.Tensor:
    has = isinstance(outputs, Mapping) and "loss" in outputs or hasattr(outputs, "loss")
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", outputs)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    fix = "HINT: return the loss tensor, or an object or dict with a 'loss' entry (the Hugging Face convention)"
    if has and loss is None:
        raise TaskError(
            f"train.loss=model: the model returned {value_words(outputs)} whose loss is None (a Hugging Face model "
            "computes it only when it gets the labels: a dict batch's labels key, train.labels_key, must be its "
            "'labels'); " + fix
        )
    raise TaskError(f"train.loss=model: the model returned {value_words(outputs)} without a one-element loss; {fix}")


def _flat(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy's (N*, C) logits and (N*,) labels from (N, ..., C) and (N, ...)."""
    if y.is_floating_point() or y.is_complex():
        raise TaskError(
            f"train.loss=cross_entropy needs integer class labels; the data gives {value_words(y)}; HINT: labels as "
            "int64 class indices, or another loss: train.loss=pkg.module.fn (e.g. torch.nn.functional.mse_loss)"
        )
    if logits.ndim != y.ndim + 1 or logits.shape[:-1] != y.shape:
        raise TaskError(
            f"train.loss=cross_entropy: the model's outputs are {value_words(logits)} and the labels {value_words(y)}; "
            "it needs outputs (N, ..., classes) for labels (N, ...); HINT: return logits with the classes last, or set "
            "train.loss to a function of (outputs, targets)"
        )
    return logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
