"""The forward overlap's optimizer side: each bucket's parameters updated the moment its allreduce is done.

After a scheduled backward pass its buckets are in flight, claimed by no one. ``step()`` claims them and records
each param group's hyperparameters (an LR scheduler may step right after): buckets already reduced are updated at
once, the others just before the first module that holds them runs its next forward (``forward.py`` registers a
forward pre-hook per module; the model's forward post-hook applies whatever is left), or at ``flush()``. Each
update is one ``optimizer.step()`` over that bucket's parameters with the recorded hyperparameters: the same step
as one optimizer over all parameters, for optimizers that update each parameter on its own
(``PER_PARAMETER_OPTIMIZERS``). Gradients belong to the reducer from backward to their update, which consumes
them: ``.grad`` is None meanwhile and after, as after ``zero_grad()``. A backward not followed by ``step()`` keeps
its averaged gradients in ``.grad``, as without the overlap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from launcher.base.sync_modes import Compress, Overlap
from launcher.comm import trace
from launcher.comm.buckets import Bucket
from launcher.comm.hooks import weak_hook

# optimizers whose step updates each parameter from its own gradient and state only: a step over a subset of the
# parameters is exactly the full step restricted to that subset
PER_PARAMETER_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)


def choose_overlap(
    asked: Overlap | str | None,
    refusal: str | None,
    compression: Compress = Compress.none,
    prefer_backward: str | None = None,
) -> tuple[Overlap, str | None]:
    """The overlap that runs and why it is backward: ``asked`` by name is kept (``prefer_backward``: the caller's
    reason for backward, shown); None is forward where it can run (``refusal``: why it cannot here,
    ``forward_overlap_refusal``) and should (not under PowerSGD, nor with ``prefer_backward`` given)."""
    wanted = Overlap.of(asked)
    if asked is not None and wanted is None:
        raise ValueError(f"overlap={asked!r}; HINT: 'forward', 'backward' or None (forward where possible)")
    if wanted is Overlap.forward and refusal is not None:
        raise ValueError(
            f"overlap='forward' cannot run here: {refusal}; HINT: pass the optimizer (SGD, AdamW, ...) as "
            "BucketedReducer(..., optimizer=opt), or use overlap='backward'"
        )
    if wanted is not None:
        return wanted, prefer_backward if wanted is Overlap.backward else None
    if refusal is not None:
        return Overlap.backward, refusal
    if compression is Compress.powersgd:  # measured in bench/compression.py: backward 10-20 % faster
        return Overlap.backward, "PowerSGD: little wire time to hide behind the next forward"
    if prefer_backward is not None:
        return Overlap.backward, prefer_backward
    return Overlap.forward, None


def forward_overlap_refusal(optimizer: torch.optim.Optimizer | None, find_unused_parameters: bool) -> str | None:
    """Why the forward overlap cannot run with these settings, or None when it can."""
    if optimizer is None:
        return "no optimizer handed to the reducer (backward returns with averaged gradients)"
    if find_unused_parameters:
        return "find_unused_parameters: the used-parameters map comes after every bucket"
    if type(optimizer) not in PER_PARAMETER_OPTIMIZERS:
        return f"{type(optimizer).__name__} is not known to update each parameter on its own"
    return None


class Waits(Protocol):
    """What the updates need of the reducer core."""

    def wait(self, indices: Sequence[int]) -> None: ...  # gradients averaged in place
    def bind_grads(self, indices: Sequence[int]) -> None: ...  # .grad = the bucket views


class BucketUpdates:
    def __init__(
        self,
        core: Waits,
        model: nn.Module,
        buckets: list[Bucket],
        where: dict[int, tuple[int, int]],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.core, self.buckets, self.optimizer = core, buckets, optimizer
        self.unclaimed = False  # buckets in flight that no step() has claimed yet
        self.hparams: list[dict] = []  # each param group's hyperparameters when step() was called
        self.waited = 0.0  # seconds waited for buckets since the last step()
        self.hooks = []
        for module in model.modules():  # each module waits for the buckets that hold its own parameters
            mine = {where[id(q)][0] for q in module.parameters(recurse=False) if id(q) in where}
            if mine:
                hook = weak_hook(self, "complete_claimed_in", tuple(sorted(mine)))
                self.hooks.append(module.register_forward_pre_hook(hook))

    def close(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def step(self) -> float:
        """Claim the buckets in flight: those whose allreduce is done are updated now, the others before their
        modules' next forward. Returns the seconds waited for buckets since the last step()."""
        self.unclaimed = False
        self.hparams = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]
        claimed = [i for i, b in enumerate(self.buckets) if b.futures]
        for i in claimed:
            self.buckets[i].claimed = True
        self._apply([i for i in claimed if all(f.done() for f in self.buckets[i].futures)])
        waited, self.waited = self.waited, 0.0
        return waited

    def flush(self) -> None:
        if self.unclaimed:
            self.keep_unclaimed()
        self.complete_claimed()

    def complete_claimed(self) -> None:
        """Every claimed update applied."""
        self.complete([i for i, b in enumerate(self.buckets) if b.claimed])

    def complete_claimed_in(self, indices: tuple[int, ...], *_: object) -> None:
        """A module's forward pre-hook: the claimed updates of the buckets that hold its parameters."""
        self.complete([i for i in indices if self.buckets[i].claimed])

    def complete(self, indices: Sequence[int]) -> None:
        """Wait for these buckets, then run their update."""
        if indices:
            self._wait(indices)
            self._apply(indices)

    def keep_unclaimed(self) -> None:
        """Buckets in flight that no step() claimed: wait, and leave their averaged gradients in ``.grad``."""
        waiting = [i for i, b in enumerate(self.buckets) if b.futures]
        self._wait(waiting)
        self.core.bind_grads(waiting)
        self.unclaimed = False

    def before_grad(self, index: int, slot: int, param: nn.Parameter) -> None:
        """A gradient arrives for bucket ``index``: a backward without a forward since step() applies the pending
        update first (it consumes the old gradient); a second backward without step() keeps the first's."""
        bucket = self.buckets[index]
        if bucket.claimed:
            fresh = param.grad
            self.complete([index])
            param.grad = fresh
        elif self.unclaimed:
            fresh = param.grad
            self.keep_unclaimed()
            if fresh is not None and bucket.sparse:  # the first pass's average is bound to .grad: add to it
                param.grad = fresh if param.grad is None else param.grad + fresh
            elif fresh is not None:
                bucket.views[slot].add_(fresh)

    def _wait(self, indices: Sequence[int]) -> None:
        start = time.perf_counter()
        for index in indices:
            if self.buckets[index].futures:
                with trace.span(f"await bucket {index}", "step"):
                    self.core.wait([index])
        self.waited += time.perf_counter() - start

    def _apply(self, indices: Sequence[int]) -> None:
        """One ``optimizer.step()`` over these buckets' parameters (their allreduces done), with the
        hyperparameters recorded by ``step()``; the other parameters are left out of the groups meanwhile. Called
        with none too (every bucket still in flight): the optimizer then counts a step, as an LR scheduler expects."""
        ids = {id(p) for index in indices for p in self.buckets[index].params}
        self.core.wait(indices)  # done already; a sparse bucket's result is bound to .grad only here
        self.core.bind_grads(indices)
        groups = self.optimizer.param_groups
        saved = [dict(g) for g in groups]
        try:
            for group, hparams in zip(groups, self.hparams):
                group.update(hparams)
                group["params"] = [p for p in group["params"] if id(p) in ids]
            with trace.span(f"optimizer, {len(indices)} bucket(s)", "step") if indices else contextlib.nullcontext():
                self.optimizer.step()
        finally:
            for group, before in zip(groups, saved):
                group.clear()
                group.update(before)
        for index in indices:
            bucket = self.buckets[index]
            bucket.claimed = False
            for p in bucket.params:  # consumed: .grad is None after the update, as after zero_grad()
                p.grad = None
