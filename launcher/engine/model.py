"""The model a loop through the engine runs (``EngineModel``: what ``Engine.setup`` returns) and, for a sharded job
that heals in place, the empty copy of the user's model that is sharded anew on the next round's mesh
(``skeleton``, ``from_skeleton``).

``EngineModel`` stays the same object for the whole run, whatever happens beneath it: its ``module`` is the user's
model (so ``parameters()`` and ``state_dict()`` are the model's, under the ``module.`` prefix a wrapper gives, as torch
DDP's), and its forward runs what the sync needs run (torch DDP's wrapper, or the model itself under our reducer
and FSDP2), under ``train.precision``'s autocast. When the job heals in place the sync is built again for the new
ranks (and under FSDP2 the model is sharded anew): the engine swaps what runs beneath (``swap``); the loop's
reference stays good."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

import torch
from torch import nn


class EngineModel(nn.Module):
    def __init__(self, module: nn.Module, run: nn.Module, device: torch.device, dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.module = module  # the user's model (sharded in place under FSDP2)
        self._run: nn.Module = run  # what the forward calls (not a child: its parameters are the module's)
        self.device_type, self.dtype = device.type, dtype

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_run":  # (kept out of nn.Module's registry: no second copy of the parameters' names)
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.dtype is None:
            return self._run(*args, **kwargs)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self._run(*args, **kwargs)

    def train(self, mode: bool = True) -> EngineModel:
        super().train(mode)
        if self._run is not self.module:
            self._run.train(mode)
        return self

    def no_sync(self) -> Any:
        """As torch DDP's (micro-batches: ``Engine.micro_batches`` does this for you)."""
        no_sync = getattr(self._run, "no_sync", None)
        return no_sync() if no_sync is not None else contextlib.nullcontext()

    def swap(self, module: nn.Module, run: nn.Module) -> None:
        """What runs beneath, after a heal: the model (a new one under FSDP2) and the sync's wrapper."""
        training = self.training
        self.module, self._run = module, run
        self.train(training)


def skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (bare, not yet sharded) whose tensors are on the meta device: its structure at no memory
    cost, to shard anew when the ranks change (its values then come from this rank's shards)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def from_skeleton(empty: nn.Module, device: torch.device) -> nn.Module:
    """A new model from ``skeleton``'s copy, its tensors allocated (uninitialised) on ``device``."""
    return copy.deepcopy(empty).to_empty(device=device)
