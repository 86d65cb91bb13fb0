"""Data sets and a model for the batch-structure tests (issue 48): the same samples as a tuple, a dict, a nested
dict or a dataclass, and a model that takes each (``data._target_=harness.structured.samples``,
``model._target_=harness.structured.Net``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

FEATURES, CLASSES = 12, 2


@dataclass
class Sample:
    x: torch.Tensor
    labels: torch.Tensor


class Structured(Dataset):
    def __init__(self, kind: str, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kind = kind
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0.8).long()  # imbalanced: F1 differs from accuracy

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x, y = self.x[i], self.y[i]
        if self.kind == "tuple":
            return x, y
        if self.kind == "dict":
            return {"x": x, "labels": y}
        if self.kind == "nested":
            return {"inputs": {"x": x, "scale": torch.tensor(1.0)}, "labels": y}
        return Sample(x, y)


def samples(kind: str = "tuple", train: int = 256, test: int = 96):
    return Structured(kind, train, 0), Structured(kind, test, 1)


class Net(nn.Module):
    """An MLP that takes ``x`` positionally, as a keyword, or inside a dict ``inputs`` (nested)."""

    def __init__(self, hidden: int = 16, **_: object) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))

    def forward(self, x: torch.Tensor | None = None, inputs: dict | None = None) -> torch.Tensor:
        if inputs is not None:
            x = inputs["x"] * inputs["scale"][:, None]
        assert x is not None
        return self.body(x)


def batch_f1(preds: torch.Tensor, targets: torch.Tensor) -> float:
    """F1 of one batch (a function metric: averaged over batches, which F1 is not)."""
    from torchmetrics.functional.classification import multiclass_f1_score

    return float(multiclass_f1_score(preds, targets, num_classes=CLASSES, average="macro"))
