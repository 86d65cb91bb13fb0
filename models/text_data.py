"""A generated text-classification data set (no download), the example of ``data._target_`` with dict samples::

    python -m launcher model=text_classifier data=text_classification train.loss=model

(``conf/data/text_classification.yaml`` names ``text_classification`` and its arguments as ``data.kwargs``.)

Each sample is a dict ``{"input_ids": int64 (seq_len,), "attention_mask": int64 (seq_len,), "labels": int64 ()}``:
a sentence of random length in [seq_len // 4, seq_len] of tokens in [1, vocab_size), padded on the right with 0s
(``attention_mask`` 1 on the real tokens). Its label is 1 when the sentence holds more of the POSITIVE tokens than
of the NEGATIVE ones (a count ``TextClassifier`` learns in about a hundred steps), else 0: about 36 % of the
samples are positive, so a predictor that always says 0 has an accuracy near 0.64 and an F1 of 0, and F1 differs
from accuracy in general. The same seed gives the same samples on every rank and in every run."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import Dataset

POSITIVE = (1, 2, 3, 4)  # token ids that count for label 1
NEGATIVE = (5, 6, 7, 8)  # token ids that count against it


class TextClassification(Dataset):
    """Map-style: ``len``, and ``[i]`` a dict of the i-th sample's tensors (the module docstring says which)."""

    def __init__(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> None:
        self.input_ids, self.attention_mask, self.labels = input_ids, attention_mask, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }


def text_classification(
    train_samples: int = 2048, test_samples: int = 512, vocab_size: int = 64, seq_len: int = 32, seed: int = 0
) -> tuple[TextClassification, TextClassification]:
    """(train, test): ``train_samples`` and ``test_samples`` different sentences drawn from ``seed`` (the module
    docstring says how). ``vocab_size`` is the model's (token ids in [0, vocab_size), 0 the padding) and
    ``seq_len`` at most its ``max_len``."""
    if vocab_size <= max(NEGATIVE) + 1 or seq_len < 4 or min(train_samples, test_samples) < 1:
        raise ValueError(
            f"text_classification needs vocab_size > {max(NEGATIVE) + 1}, seq_len >= 4 and at least one sample a "
            f"split, got vocab_size={vocab_size} seq_len={seq_len} train_samples={train_samples} "
            f"test_samples={test_samples}"
        )
    g = torch.Generator().manual_seed(seed)
    n = train_samples + test_samples
    lengths = torch.randint(seq_len // 4, seq_len + 1, (n, 1), generator=g)
    mask = (torch.arange(seq_len).unsqueeze(0) < lengths).long()
    # the counted tokens are as likely as any other, so that both labels are common at every length
    ids = torch.randint(1, vocab_size, (n, seq_len), generator=g) * mask
    count = lambda tokens: torch.isin(ids, torch.tensor(tokens)).sum(1)  # noqa: E731 (padding, 0, is in neither)
    labels = (count(POSITIVE) > count(NEGATIVE)).long()
    split = lambda lo, hi: TextClassification(ids[lo:hi].clone(), mask[lo:hi].clone(), labels[lo:hi].clone())  # noqa: E731
    return split(0, train_samples), split(train_samples, n)
