"""What an evaluation reports besides its loss (``train.metrics``): each named metric computed over the whole
held-out split, every rank's share of it (each sample once: ``data.eval_loader``), and reported under its own name
(the console, ``metrics.jsonl``'s ``test_<name>``, ``summary.json``'s ``test_metrics``, TensorBoard's
``eval/<name>``, the curves).

A metric is named by its ``_target_`` (with its arguments beside it), or by the path alone:

- a metric object (a class whose instances ``update(preds, targets)``, ``compute()``, ``reset()``: a torchmetrics
  ``Metric`` such as ``torchmetrics.classification.BinaryF1Score``, an F1, AUROC or perplexity): it sees every batch
  and computes the value of the whole evaluation, its states synchronised across the ranks by torchmetrics itself;
- a function ``fn(preds, targets) -> value``: its batch values are averaged, weighted by the batch's samples (said
  so in the log: not the whole-set value of a metric that is not a mean, such as F1).

``preds``: the model's output tensor, or its ``logits`` (``batch.predictions``); ``targets``: the batch's
(``batch.split``). The built-in loss's accuracy (``train.loss=cross_entropy``) is reported as ``accuracy`` besides."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any, Optional

import torch
from hydra.utils import get_object

from launcher.config.targets import Target, build_error
from launcher.group.helpers import Peers
from launcher.train.batch import Batch, need_targets, predictions

log = logging.getLogger(__name__)


class Score:
    """One metric of ``train.metrics``: ``metric`` is an object with update/compute/reset, or ``function``."""

    def __init__(self, name: str, made: Any, averaged: bool) -> None:
        self.name, self.made, self.averaged = name, made, averaged
        self.total, self.samples = 0.0, 0.0  # a function's batch values, weighted by samples

    def to(self, device: torch.device) -> Score:
        if not self.averaged and hasattr(self.made, "to"):
            self.made = self.made.to(device)
        return self


def build(name: str, spec: Any) -> Score:
    """``train.metrics.<name>``: ``{_target_: path, **arguments}`` or the path alone."""
    if isinstance(spec, str):
        target, kwargs = spec, {}
    elif isinstance(spec, Mapping) and isinstance(spec.get("_target_"), str):
        target, kwargs = spec["_target_"], {k: v for k, v in spec.items() if k != "_target_"}
    else:
        raise ValueError(
            f"train.metrics.{name}={spec!r}; HINT: train.metrics.{name}._target_=torchmetrics.classification."
            "BinaryF1Score (a metric class, its arguments beside _target_), or a function of (preds, targets)"
        )
    found = get_object(target)
    try:
        made = found(**kwargs) if isinstance(found, type) else functools.partial(found, **kwargs) if kwargs else found
    except Exception as exc:  # noqa: BLE001 - the user's metric: whatever its constructor raises is named
        key = f"train.metrics.{name}"
        said = Target(key if isinstance(spec, str) else f"{key}._target_", target, at=key)
        raise ValueError(build_error(said, found, list(kwargs), exc)) from exc
    if all(callable(getattr(made, m, None)) for m in ("update", "compute", "reset")):
        return Score(name, made, averaged=False)
    if callable(made):
        return Score(name, made, averaged=True)
    raise ValueError(f"train.metrics.{name}: {target} made a {type(made).__name__}, neither a metric nor a function")


def metric_specs(train: Any) -> dict[str, Any]:
    """``train.metrics`` (name -> spec), with the older ``train.metric=pkg.fn`` as a function named ``fn``."""
    specs: dict[str, Any] = {}
    if train.metric:
        specs[str(train.metric).rsplit(".", 1)[-1]] = str(train.metric)
    return {**specs, **dict(train.metrics)}


class Scores:
    """Every metric of ``train.metrics`` for one evaluation: ``update`` per batch, ``compute`` at its end
    (collective)."""

    def __init__(self, specs: Mapping[str, Any], labels_key: str) -> None:
        self.specs, self.labels_key = dict(specs), labels_key
        self.scores: list[Score] = []

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def start(self, device: torch.device) -> None:
        """Fresh metrics for an evaluation (built anew: a job healed in place has another process group)."""
        self.scores = [build(name, spec).to(device) for name, spec in self.specs.items()]
        averaged = [s.name for s in self.scores if s.averaged]
        if averaged:
            log.info("train.metrics %s: functions, averaged over batches weighted by samples", ", ".join(averaged))

    def check(self, outputs: Any, batch: Batch, device: torch.device) -> None:
        """At the first step, on a training batch's outputs: each metric takes them (its shapes, its arguments), or
        the error names it now rather than at the end of the first evaluation. No collective."""
        if not self.specs:
            return
        preds = predictions(outputs, f"train.metrics ({', '.join(self.names)})").detach()
        targets = need_targets(batch, self.labels_key, f"train.metrics ({', '.join(self.names)})")
        for name, spec in self.specs.items():
            score = build(name, spec).to(device)
            try:
                score.made(preds, targets) if score.averaged else score.made.update(preds, targets)
            except Exception as exc:  # noqa: BLE001 - the user's metric: whatever it raises is named
                raise ValueError(
                    f"train.metrics.{name} does not take this model's predictions ({_shape(preds)}) and targets "
                    f"({_shape(targets)}): {exc}; HINT: a metric for these shapes (e.g. (N, C) logits: "
                    "MulticlassF1Score with num_classes=C; (N,) scores: BinaryF1Score)"
                ) from exc

    def update(self, outputs: Any, batch: Batch) -> None:
        if not self.scores:
            return
        preds = predictions(outputs, f"train.metrics ({', '.join(self.names)})").detach()
        targets = need_targets(batch, self.labels_key, f"train.metrics ({', '.join(self.names)})")
        for score in self.scores:
            if score.averaged:
                value = torch.as_tensor(score.made(preds, targets), dtype=torch.float64)
                score.total += float(value) * batch.size
                score.samples += batch.size
            else:
                score.made.update(preds, targets)

    def compute(self, peers: Peers, device: torch.device) -> dict[str, Optional[float]]:
        """Each metric's value over the whole evaluation, every rank's share (collective, in a fixed order)."""
        values: dict[str, Optional[float]] = {}
        averaged = [s for s in self.scores if s.averaged]
        if averaged:
            sums = torch.tensor([[s.total, s.samples] for s in averaged], dtype=torch.float64, device=device)
            peers.all_reduce(sums)
            for score, (total, samples) in zip(averaged, sums.tolist()):
                values[score.name] = total / samples if samples else None
        for score in self.scores:
            if not score.averaged:
                values[score.name] = _number(score.made.compute(), score.name)
                score.made.reset()
        return {name: values[name] for name in self.names}


def _number(value: Any, name: str) -> float:
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1:
        raise ValueError(
            f"train.metrics.{name} computed a {tuple(tensor.shape)} value, not one number; HINT: an averaged metric "
            "(e.g. average='macro' for per-class metrics)"
        )
    return float(tensor)


def _shape(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
