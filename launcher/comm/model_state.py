"""The model's state across ranks, kept as torch DDP keeps it (``torch/distributed/utils.py``,
``_sync_module_states``): collectives on the default group, nothing of the buckets.

- At construction every rank must hold the same parameters and buffers (names, shapes, dtypes, one order): the
  first difference is named. Then everyone starts from rank 0's parameters (frozen ones too) and buffers.
- Before a forward, rank 0's buffers are broadcast again (``broadcast_buffers``, DDP's rule: when the previous
  forward ran with gradients and synchronisation). With ``broadcast_buffers=False`` buffers stay each rank's own.
- A model whose parameters changed after the reducer was built (a layer added or replaced) is refused at its next
  forward: DDP would train the new parameters without reducing them, the ranks silently diverging.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from launcher.group.helpers import Peers


def check_same_model(model: nn.Module, peers: Optional[Peers] = None) -> None:
    """Every rank must hold the same parameters and buffers, in one order: name the first difference (``peers``:
    the job's secret signs the gathered objects, its abort signal leaves the gather)."""
    mine = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    mine += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    everyone = (peers or Peers()).all_gather_object(mine)
    for rank, theirs in enumerate(everyone):
        for i in range(max(len(theirs), len(everyone[0]))):
            ours = everyone[0][i] if i < len(everyone[0]) else None
            other = theirs[i] if i < len(theirs) else None
            if ours != other:
                show = lambda e: f"{e[0]} {e[1]!r} {list(e[2])} {e[3]}" if e else "nothing"  # noqa: E731
                raise ValueError(
                    f"rank {rank}'s model differs from rank 0's at entry {i}: {show(other)} there, {show(ours)} on "
                    "rank 0; HINT: build the same model on every rank (the same code and config) before the reducer"
                )


class ModelState:
    """One model's parameters and buffers, the same on every rank."""

    def __init__(
        self, model: nn.Module, world_size: int, broadcast_buffers: bool, peers: Optional[Peers] = None
    ) -> None:
        self.model = model
        self.world_size = world_size
        self.broadcast_buffers = broadcast_buffers
        self.names = {id(p): n for n, p in model.named_parameters()}  # named_parameters dedupes tied ones
        self.buffers = list(model.buffers())
        self.buffers_due = True  # DDP's require_forward_param_sync
        if world_size > 1:
            check_same_model(model, peers)
            with torch.no_grad():
                for tensor in [*model.parameters(), *(self.buffers if broadcast_buffers else [])]:
                    dist.broadcast(tensor, src=0)

    def check_unchanged(self) -> None:
        now = {id(p): n for n, p in self.model.named_parameters()}
        if now.keys() != self.names.keys():
            new = [n for i, n in now.items() if i not in self.names]
            gone = [n for i, n in self.names.items() if i not in now]
            raise RuntimeError(
                f"the model's parameters changed after the reducer was built (new: {', '.join(new) or '-'}; gone: "
                f"{', '.join(gone) or '-'}): their gradients would not be reduced; HINT: finish building the model "
                "(or load its final form) before creating the reducer, or create a new reducer after the change"
            )

    def sync_buffers(self) -> None:
        """Before a forward: rank 0's buffers, when the previous forward ran with gradients and synchronisation."""
        if self.broadcast_buffers and self.buffers_due and self.buffers and self.world_size > 1:
            with torch.no_grad():
                for buffer in self.buffers:
                    dist.broadcast(buffer, src=0)

    def after_forward(self, synchronised: bool) -> None:
        self.buffers_due = torch.is_grad_enabled() and synchronised
