"""A small Transformer text classifier shaped like a Hugging Face model: it takes a dict batch by keyword
(``model(**batch)``), computes its own loss from ``labels`` and returns an output with ``.loss`` and ``.logits``
(also readable as ``out["logits"]``). With the generated data set of ``models.text_data``::

    python -m launcher model=text_classifier data=text_classification train.loss=model

Batches are dicts of ``input_ids`` (int64, (N, T), T <= max_len, 0 the padding id), ``attention_mask`` (int64 or
bool, (N, T), 1 for a real token and 0 for padding, at least one real token a row; optional: all real) and
``labels`` (int64, (N,), in [0, num_classes); optional: without it ``loss`` is None), which is what a DataLoader's
default collation makes of samples ``{"input_ids": (T,), "attention_mask": (T,), "labels": ()}``.

Pure torch (``nn.TransformerEncoder``): learned token and position embeddings, pre-norm encoder layers, the mean of
the real tokens' states, a linear head. About 236 K parameters with the defaults."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(eq=False)
class ClassifierOutput(Mapping[str, Tensor]):
    """What ``forward`` returns, as Hugging Face's ``SequenceClassifierOutput``: attributes, and a mapping of the
    fields that are not None (``out["logits"]``, ``dict(out)``; without labels ``"loss" not in out``)."""

    logits: Tensor  # (N, num_classes)
    loss: Optional[Tensor] = None  # the mean cross-entropy over the batch, a scalar; None without labels

    def __getitem__(self, key: str) -> Tensor:
        value = getattr(self, key, None) if isinstance(key, str) else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in fields(self) if getattr(self, f.name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class TextClassifier(nn.Module):
    """``forward(input_ids, attention_mask=None, labels=None) -> ClassifierOutput``; the module docstring says the
    batch's shape. ``d_model`` must divide into ``heads``; the feed-forward is ``4 * d_model`` wide."""

    def __init__(
        self,
        vocab_size: int = 64,
        num_classes: int = 2,
        d_model: int = 96,
        heads: int = 4,
        layers: int = 2,
        max_len: int = 64,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} does not split into heads={heads}; HINT: a multiple of heads")
        if min(vocab_size, num_classes, layers, max_len) < 1 or num_classes < 2:
            raise ValueError(
                f"TextClassifier needs vocab_size, layers, max_len >= 1 and num_classes >= 2, got "
                f"vocab_size={vocab_size} layers={layers} max_len={max_len} num_classes={num_classes}"
            )
        self.max_len = max_len
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=0)
        self.positions = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=dropout, batch_first=True, norm_first=True
        )
        # enable_nested_tensor=False: the same kernels in train and eval (and no warning about pre-norm layers)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None
    ) -> ClassifierOutput:
        if input_ids.ndim != 2 or input_ids.shape[1] > self.max_len:
            raise ValueError(
                f"input_ids of shape {tuple(input_ids.shape)}: expected (batch, T) with T <= max_len={self.max_len}"
            )
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        where = torch.arange(input_ids.shape[1], device=input_ids.device)
        states = self.encoder(self.tokens(input_ids) + self.positions(where), src_key_padding_mask=~real)
        weights = real.unsqueeze(-1).to(states.dtype)
        pooled = (states * weights).sum(1) / weights.sum(1).clamp_min(1.0)  # the mean over the real tokens
        logits = self.head(pooled)
        loss = None if labels is None else F.cross_entropy(logits.float(), labels.long())
        return ClassifierOutput(logits=logits, loss=loss)
