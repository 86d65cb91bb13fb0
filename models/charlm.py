"""A character-level language model with per-token targets, the README's example of a task other than image
classification (``train.loss``): a GRU over character ids predicting the next character at every position, on a
text generated here (no download). Either the launcher's cross-entropy on its logits (classes last, per token)::

    python -m launcher model._target_=models.charlm.CharGRU data._target_=models.charlm.text_data

or its own loss (``forward(ids, targets)`` returning an object with ``.loss``, the Hugging Face convention)::

    python -m launcher model._target_=models.charlm.CharGRU +model.own_loss=true train.loss=model \\
        data._target_=models.charlm.text_data
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

VOCAB = 32  # a-z, space, and five punctuation marks: the generated text's alphabet
WORDS = "the a launcher trains every rank node machine gradient bucket ring tree step loss model data".split()


@dataclass
class Output:
    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None


class CharGRU(nn.Module):
    def __init__(self, vocab: int = VOCAB, embed: int = 32, hidden: int = 64, own_loss: bool = False) -> None:
        super().__init__()
        self.embed, self.gru = nn.Embedding(vocab, embed), nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)
        self.own_loss = own_loss

    def forward(self, ids: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor | Output:
        states, _ = self.gru(self.embed(ids))
        logits = self.head(states)  # (N, T, vocab): the classes last
        if not self.own_loss:
            return logits
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return Output(logits, loss)


def text_data(
    seq_len: int = 32, train_sequences: int = 2048, test_sequences: int = 256, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) of (ids (seq_len,), next ids (seq_len,)) from a generated text of WORDS: learnable (words repeat,
    their letters follow each other) and the same for every rank and run."""
    g = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz .,;:!"
    total = (train_sequences + test_sequences) * (seq_len + 1)
    words = [WORDS[i] for i in torch.randint(len(WORDS), (total // 3,), generator=g).tolist()]
    text = " ".join(words)[:total]
    ids = torch.tensor([alphabet.index(c) for c in text], dtype=torch.int64).view(-1, seq_len + 1)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    cut = train_sequences
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``train.loss=models.charlm.token_loss``: the mean cross-entropy over every position (a loss of your own)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def token_accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``train.metric=models.charlm.token_accuracy``: the share of next characters predicted right."""
    logits = outputs.logits if isinstance(outputs, Output) else outputs
    return (logits.argmax(-1) == targets).float().mean()
