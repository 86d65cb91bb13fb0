"""The tail of the forward overlap: its first chunks sent while backward still computes them.

Backward produces the first layer's weight gradient last, and the next forward needs that layer first: its
allreduce is the one piece of communication nothing after backward can hide (bench/README.md, "Overlap at defaults").
When that layer is an ``nn.Linear``, the forward overlap replaces its ``forward`` (``TailLinear``, removed by
``close()``) by one autograd Function whose backward computes the weight gradient in row blocks of about a chunk
each, straight into the bucket, and hands every chunk to the link the moment its rows exist: the first chunks
travel while the later rows are still being computed. It talks to the forward overlap (``forward.py``) through
``TailSink`` alone.

- Which layer: the ``nn.Linear`` (that class exactly) whose weight is the last parameter of the last bucket, its
  bias (if trained) in the same bucket, both held by no other module.
- The weight gradient is computed in the same row blocks in every backward, sent early or not, so a pass that
  sends early gives the same bits as one that does not (a resumed run stays bit-identical to an uninterrupted one);
  the input's and the bias's gradients are F.linear's. To float tolerance, these equal F.linear's.
- Whether a backward sends early is the sink's decision when it begins (``TailSink.tail_start``): only
  in a synchronised forward-overlap pass, once every other gradient of the last bucket has arrived, and only when
  the layer's graph is the only one alive (the layer called twice in a forward, two forwards' graphs alive, a
  second backward through a retained graph: the plain path). Otherwise the Function returns its gradients to
  autograd as F.linear would.
- A weight (or bias) read outside its module too gets that part of its gradient through autograd, after its early
  chunks left: the forward overlap reduces that part on its own, adds it, and stops sending that layer early (a
  warning).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
from torch import nn
from torch.nn import functional as F


class TailSink(Protocol):
    """Where the tail layer's weight gradient goes, row block by row block (the forward overlap)."""

    tail: TailLinear | None  # the layer it sends early now (None: none any more)

    def tail_start(self, bias_grad: torch.Tensor | None) -> torch.Tensor | None: ...  # the view to fill, or None
    def tail_rows(self, rows: int, block: torch.Tensor) -> None: ...  # rows up to ``rows`` computed
    def tail_end(self) -> None: ...  # the weight's gradient is complete


class _CallMark:
    """One call's mark: alive while that call's graph is and its backward has not run."""

    def __init__(self) -> None:
        self.plain = False  # another call's graph was alive beside this one: the plain path


class TailLinear:
    """Installed as ``module.forward`` of the tail layer; forwards without gradients run ``F.linear`` itself."""

    def __init__(self, sink: weakref.ref[TailSink], module: nn.Linear, chunk_bytes: int) -> None:
        self.sink, self.module = sink, module
        row_bytes = module.in_features * module.weight.element_size()
        self.rows = max(1, chunk_bytes // row_bytes)  # per block: about one chunk
        self.live: weakref.WeakSet[_CallMark] = weakref.WeakSet()
        module.forward = self  # type: ignore[method-assign]

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.forward

    def __reduce__(self) -> tuple[Callable[[nn.Linear], Callable[[torch.Tensor], torch.Tensor]], tuple[nn.Linear]]:
        """Deep-copied (or pickled) with its module, the copy's forward is nn.Linear's own: this one belongs to
        the forward overlap, and a copy must not send into its buckets."""
        return _plain_forward, (self.module,)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        m = self.module
        if not (torch.is_grad_enabled() and m.weight.requires_grad) or torch.is_autocast_enabled(input.device.type):
            return F.linear(input, m.weight, m.bias)
        mark = _CallMark()
        self.live.add(mark)
        return _RowBlockLinear.apply(input, m.weight, m.bias, self, mark)

    def chunk_shares(self, weight: torch.Tensor, chunks: list[torch.Tensor]) -> list[float]:
        """Per chunk of the bucket holding ``weight`` (this layer's gradient view, the bucket's end): the share of
        its rows computed when the chunk can be sent."""
        row, rows = weight.stride(0) * weight.element_size(), weight.shape[0]
        shares = []
        for chunk in chunks:
            end = chunk.data_ptr() + chunk.numel() * chunk.element_size() - weight.data_ptr()  # bytes into weight
            needed = max(1, -(-end // row))
            shares.append(min(rows, -(-needed // self.rows) * self.rows) / rows)
        return shares

    def start(self, mark: _CallMark, bias_grad: torch.Tensor | None) -> torch.Tensor | None:
        """The backward of the forward ``mark`` begins: the bucket view to compute the weight gradient into, rows
        sent as they come (None: the plain path)."""
        if len(self.live) > 1:  # the layer called twice, two forwards' graphs alive...: all of them plain
            for other in self.live:
                other.plain = True
        alone = mark in self.live and not mark.plain
        self.live.discard(mark)
        sink = self.sink()
        return sink.tail_start(bias_grad) if alone and sink is not None and sink.tail is self else None


def _plain_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return types.MethodType(nn.Linear.forward, module)


class _RowBlockLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        owner: TailLinear,
        mark: _CallMark,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.owner, ctx.mark, ctx.has_bias = owner, mark, bias is not None
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        input, weight = ctx.saved_tensors
        owner: TailLinear = ctx.owner
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad2 = grad.reshape(-1, grad.shape[-1])
        input2 = input.reshape(-1, input.shape[-1])
        grad_bias = grad2.sum(0) if ctx.has_bias and need_bias else None
        into = owner.start(ctx.mark, grad_bias) if need_weight else None
        sink = owner.sink() if into is not None else None  # said yes in start(): the rows go to its bucket
        grad_weight = into if sink is not None else torch.empty_like(weight) if need_weight else None
        if grad_weight is not None:
            rows = weight.shape[0]
            for first in range(0, rows, owner.rows):
                last = min(rows, first + owner.rows)
                block = grad_weight[first:last]
                torch.mm(grad2[:, first:last].t(), input2, out=block)
                if sink is not None:
                    sink.tail_rows(last, block)
        grad_input = grad.matmul(weight) if need_input else None
        if sink is not None:
            sink.tail_end()
            return grad_input, None, None, None, None
        return grad_input, grad_weight, grad_bias, None, None


def tail_linear(model: nn.Module, last: list[nn.Parameter]) -> nn.Linear | None:
    """The layer whose weight gradient may be sent in row blocks: an ``nn.Linear`` whose weight is the last of
    ``last`` (the last bucket's parameters), its trained bias among them, neither held by another module."""
    weight = last[-1]
    holders = [m for m in model.modules() if any(q is weight for q in m.parameters(recurse=False))]
    if len(holders) != 1 or type(holders[0]) is not nn.Linear or holders[0].weight is not weight:
        return None
    layer = holders[0]
    bias = layer.bias
    if bias is not None and bias.requires_grad:
        if not any(q is bias for q in last):
            return None
        if sum(any(q is bias for q in m.parameters(recurse=False)) for m in model.modules()) != 1:
            return None
    if weight.dim() != 2 or weight.is_sparse:
        return None
    return layer
