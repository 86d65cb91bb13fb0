"""What the built-in trainer minimises and reports, for any task (``train.loss``, ``train.metric``):

- ``cross_entropy`` (default): ``model(inputs)`` gives logits with the classes last, (N, C) for one label per sample
  or (N, ..., C) for a label per position (a language model's per-token targets, (N, ...)); the loss is the mean over
  every label, the accuracy the share of labels right.
- ``model``: ``model(inputs, targets)`` returns the loss itself, or an object or dict with ``loss`` (the Hugging Face
  convention); evaluation reports its loss (no accuracy unless ``train.metric``).
- ``pkg.module.fn``: ``fn(outputs, targets) -> loss`` on ``model(inputs)`` (mean over the batch).

``train.metric``: ``pkg.module.fn(outputs, targets) -> value`` (mean over the batch), reported as the test
"accuracy" in place of cross-entropy's. What does not fit (a tuple from the model, float labels for cross-entropy,
shapes that do not line up) is named at the first step with the value, the expectation and the fix.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from hydra.utils import get_method
from torch import nn

BUILT_IN = ("cross_entropy", "model")


class TaskError(TypeError):
    """The model's outputs or the data's targets do not fit ``train.loss``: says which, and the fix."""


class Task:
    def __init__(self, loss: str = "cross_entropy", metric: Optional[str] = None) -> None:
        self.kind = loss if loss in BUILT_IN else "callable"
        self.loss_fn = None if loss in BUILT_IN else get_method(loss)
        self.metric = get_method(metric) if metric else None
        self.name = loss

    @property
    def has_accuracy(self) -> bool:
        return self.kind == "cross_entropy" or self.metric is not None

    def outputs(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
        return model(x, y) if self.kind == "model" else model(x)

    def loss(self, outputs: Any, y: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss (a scalar tensor)."""
        if self.kind == "model":
            return _model_loss(outputs)
        logits = _tensor(outputs, self.name)
        if self.kind == "cross_entropy":
            flat, labels = _flat(logits, y)
            return F.cross_entropy(flat, labels)
        loss = self.loss_fn(logits, y)  # type: ignore[misc]
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            raise TaskError(f"train.loss={self.name} returned {_what(loss)}, not a one-element loss tensor")
        return loss.reshape(())

    def eval_sums(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(loss sum, loss count, metric sum, metric count) of one held-out batch, in float64."""
        outputs = self.outputs(model, x, y)
        n = float(y.shape[0])
        if self.kind == "cross_entropy" and self.metric is None:
            flat, labels = _flat(_tensor(outputs, self.name), y)
            right = (flat.argmax(-1) == labels).sum().double()
            count = float(labels.numel())
            loss_sum = F.cross_entropy(flat.float(), labels, reduction="sum").double()
            return torch.stack([loss_sum, _f64(count, y), right, _f64(count, y)])
        loss = self.loss(outputs, y).double() * n
        value = torch.as_tensor(self.metric(outputs, y), dtype=torch.float64, device=y.device) * n if self.metric else 0
        return torch.stack([loss, _f64(n, y), _f64(value, y), _f64(n if self.metric else 0.0, y)])


def _f64(value: Any, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.float64, device=like.device).reshape(())


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} tensor"
    return f"a {type(value).__name__}"


def _tensor(outputs: Any, loss: str) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    hint = "return the logits as one tensor, or compute the loss in the model: train.loss=model (forward(inputs, "
    hint += "targets) returning the loss, or an object or dict with .loss)"
    raise TaskError(f"the model returned {_what(outputs)}, but train.loss={loss} needs a tensor; HINT: {hint}")


def _model_loss(outputs: Any) -> torch.Tensor:
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", outputs)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    raise TaskError(
        f"train.loss=model: the model's forward(inputs, targets) returned {_what(outputs)} without a one-element "
        "loss; HINT: return the loss tensor, or an object or dict with a 'loss' entry (the Hugging Face convention)"
    )


def _flat(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy's (N*, C) logits and (N*,) labels from (N, ..., C) and (N, ...)."""
    if y.is_floating_point() or y.is_complex():
        raise TaskError(
            f"train.loss=cross_entropy needs integer class labels; the data gives {_what(y)}; HINT: labels as "
            "int64 class indices, or another loss: train.loss=pkg.module.fn (e.g. torch.nn.functional.mse_loss)"
        )
    if logits.ndim != y.ndim + 1 or logits.shape[:-1] != y.shape:
        raise TaskError(
            f"train.loss=cross_entropy: the model's outputs are {_what(logits)} and the labels {_what(y)}; it needs "
            "outputs (N, ..., classes) for labels (N, ...); HINT: return logits with the classes last, or set "
            "train.loss to a function of (outputs, targets)"
        )
    return logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
