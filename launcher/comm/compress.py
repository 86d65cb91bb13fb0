"""What crosses nodes, compressed: the leaders' stage of a node-first allreduce (``collectives.py``), and only
that: the sum inside a node stays exact, and a one-node job has nothing to compress.

- ``none``: the leaders' allreduce as it is, in segments of the pipeline's size.
- ``bf16``: the leaders' allreduce in bfloat16 (half the bytes), rounded back into the fp32 bucket.
- ``powersgd``: rank-``r`` PowerSGD (Vogels et al., 2019) on every whole weight matrix of a bucket (a conv kernel
  reshaped to ``(out, in*kh*kw)``, as torch's hook does); vectors, and matrices too small to gain, travel
  uncompressed. Per matrix M (this leader's node sum, plus its error): ``P = M Q`` summed over the leaders and
  orthonormalised, ``Q' = M^T P`` summed, and ``P Q'^T`` replaces M. What this leader did not send,
  ``M - P (M^T P)^T``, is its error, added to the next step's M (error feedback); ``Q'`` starts the next step
  (warm start). Every collective is issued by the stage, on the pipeline's leaders' thread (under NCCL the
  caller's), in launch order: never from a completion callback, so several buckets and either overlap work.

Every leader orthonormalises the same summed ``P`` with the same code: identical machines get identical results
(as for any replica-computed update); the first ``warmup_steps`` steps go uncompressed. ``state_dict`` holds the
errors and Qs of this leader with the layout they belong to (``fingerprint``); a different layout resets them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import trace
from .sizes import mb

MODES = ("none", "bf16", "powersgd")
Stage = Callable[[torch.Tensor, Any], None]  # (a 1-D piece of a bucket, the leaders' group): reduces it in place


def plain_stage(piece: torch.Tensor, group: Any) -> None:
    dist.all_reduce(piece, group=group)


@dataclass(frozen=True)
class Matrix:
    """One parameter's gradient inside a bucket: its view (any shape) and its key (the parameter's index in the
    model, the same on every rank)."""

    view: torch.Tensor
    key: int


def segments(tensor: torch.Tensor, elements: int) -> list[torch.Tensor]:
    return list(tensor.view(-1).split(max(1, elements)))


class Compression:
    """``none``: the base. ``plan(tensor, matrices, elements)`` cuts a tensor into the pieces the pipeline moves,
    each with the leaders' stage that reduces it; ``begin_step()`` once per synchronised step (the warm-up)."""

    name = "none"

    def __init__(self, warmup_steps: int = 0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.warmup_steps, self.steps = warmup_steps, 0

    @property
    def active(self) -> bool:
        return self.name != "none" and self.steps > self.warmup_steps

    def begin_step(self) -> bool:
        """A synchronised step begins; True when compression starts with it (what crosses the link changes)."""
        self.steps += 1
        return self.name != "none" and self.steps == self.warmup_steps + 1

    def plan(self, tensor: torch.Tensor, matrices: Sequence[Matrix], elements: int) -> list[tuple[torch.Tensor, Stage]]:
        return [(s, plain_stage) for s in segments(tensor, elements)]

    def describe(self) -> str:
        return "uncompressed"

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> str:
        """Take over a saved state; returns why it was (partly) reset, or ""."""
        self.steps = int(state.get("steps", 0))
        return ""


class Bf16(Compression):
    name = "bf16"

    def plan(self, tensor: torch.Tensor, matrices: Sequence[Matrix], elements: int) -> list[tuple[torch.Tensor, Stage]]:
        stage = _bf16_stage if self.active else plain_stage
        return [(s, stage) for s in segments(tensor, elements)]

    def describe(self) -> str:
        return f"bf16 across nodes (after {self.warmup_steps} step(s) uncompressed)"


def _bf16_stage(piece: torch.Tensor, group: Any) -> None:
    if piece.dtype != torch.float32:
        dist.all_reduce(piece, group=group)
        return
    low = piece.to(torch.bfloat16)
    dist.all_reduce(low, group=group)
    piece.copy_(low)


def matrix_shape(view: torch.Tensor) -> tuple[int, int] | None:
    """(rows, columns) of a weight as PowerSGD sees it: dimension 0 by the rest; None for a vector."""
    if view.dim() < 2:
        return None
    return view.shape[0], view.numel() // view.shape[0]


class PowerSGD(Compression):
    name = "powersgd"

    def __init__(self, rank: int = 4, warmup_steps: int = 0, seed: int = 0, min_gain: float = 2.0) -> None:
        """``min_gain``: a matrix is compressed when it holds at least this many times its two factors' elements
        (0: every matrix; tests)."""
        super().__init__(warmup_steps)
        if rank < 1:
            raise ValueError(f"rank={rank} must be >= 1")
        self.rank, self.seed, self.min_gain = rank, seed, min_gain
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self.shapes: dict[int, tuple[int, int]] = {}
        self.lock = threading.Lock()  # the leaders' thread writes the state; a checkpoint reads it

    def compresses(self, shape: tuple[int, int] | None) -> bool:
        if shape is None:
            return False
        n, m = shape
        return min(self.rank, n, m) * (n + m) * self.min_gain <= n * m

    def plan(self, tensor: torch.Tensor, matrices: Sequence[Matrix], elements: int) -> list[tuple[torch.Tensor, Stage]]:
        if not self.active:
            return [(s, plain_stage) for s in segments(tensor, elements)]
        flat = tensor.view(-1)
        base, size, end = flat.data_ptr(), flat.element_size(), flat.numel()
        whole = []  # (offset, matrix) of each compressible matrix lying wholly in ``tensor``
        for m in matrices:
            offset = (m.view.data_ptr() - base) // size
            if 0 <= offset and offset + m.view.numel() <= end and self.compresses(matrix_shape(m.view)):
                whole.append((offset, m))
        pieces: list[tuple[torch.Tensor, Stage]] = []
        at = 0
        for offset, m in sorted(whole, key=lambda item: item[0]):
            if offset > at:
                pieces += [(s, plain_stage) for s in segments(flat[at:offset], elements)]
            piece = flat[offset : offset + m.view.numel()]
            pieces.append((piece, self._stage(m.key, matrix_shape(m.view))))  # type: ignore[arg-type]
            at = offset + m.view.numel()
        if at < end:
            pieces += [(s, plain_stage) for s in segments(flat[at:], elements)]
        return pieces

    def _stage(self, key: int, shape: tuple[int, int]) -> Stage:
        return lambda piece, group: self._compress(piece, group, key, shape)

    def _start(self, key: int, shape: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This matrix's error and Q (kept transposed, ``(r, m)``: the products below then run as fast row-major
        ones, 4-8x the transposed ones on a CPU): kept, or new, from a generator seeded by the key (the same on every
        leader)."""
        if key in self.qs and self.shapes.get(key) == shape:
            return self.errors[key], self.qs[key]
        n, m = shape
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        q_t = torch.randn(min(self.rank, n, m), m, generator=generator).to(like.device)
        return torch.zeros(n, m, dtype=like.dtype, device=like.device), q_t

    def _compress(self, piece: torch.Tensor, group: Any, key: int, shape: tuple[int, int]) -> None:
        with trace.span("compress", "powersgd", mb=round(mb(piece), 3)):
            with self.lock:
                error, q_t = self._start(key, shape, piece)
            matrix = piece.view(shape)
            matrix.add_(error)
            p = (q_t @ matrix.t()).t().contiguous()  # M Q
            dist.all_reduce(p, group=group)
            p = torch.linalg.qr(p).Q
            mine_t = p.t() @ matrix  # this leader's share of Q'^T
            torch.addmm(matrix, p, mine_t, alpha=-1, out=error)  # what it does not send: M - P (M^T P)^T
            dist.all_reduce(mine_t, group=group)
            torch.mm(p, mine_t, out=matrix)
            with self.lock:
                self.errors[key], self.qs[key], self.shapes[key] = error, mine_t, shape

    def describe(self) -> str:
        return f"PowerSGD rank {self.rank} across nodes (after {self.warmup_steps} step(s) uncompressed)"

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                **super().state_dict(),
                "rank": self.rank,
                "fingerprint": [[key, *self.shapes[key]] for key in sorted(self.shapes)],
                "errors": {k: v.clone() for k, v in self.errors.items()},
                "qs": {k: v.clone() for k, v in self.qs.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> str:
        super().load_state_dict(state)
        with self.lock:
            self.errors.clear()
            self.qs.clear()
            self.shapes.clear()
            if state.get("mode") != self.name or state.get("rank") != self.rank:
                return f"saved with {state.get('mode')} rank {state.get('rank')}: errors and Qs start anew"
            for key, n, m in state.get("fingerprint", []):
                self.errors[key], self.qs[key] = state["errors"][key], state["qs"][key]
                self.shapes[key] = (n, m)
        return ""


def build_compression(mode: str, rank: int = 4, warmup_steps: int = 0, seed: int = 0) -> Compression:
    if mode == "bf16":
        return Bf16(warmup_steps)
    if mode == "powersgd":
        return PowerSGD(rank, warmup_steps, seed)
    if mode == "none":
        return Compression()
    raise ValueError(f"compress={mode!r} is not one of {', '.join(MODES)}")
