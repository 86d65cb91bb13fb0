"""What crosses nodes, compressed, in a node-first allreduce (``collectives.py``): the sum inside a node stays
exact (for PowerSGD: its linear image is summed exactly), and a one-node job has nothing to compress.

- ``none``: the leaders' allreduce as it is, in segments of the pipeline's size.
- ``bf16``: the leaders' allreduce in bfloat16 (half the bytes), rounded back into the fp32 bucket.
- ``powersgd``: rank-``r`` PowerSGD (Vogels et al., 2019) on every whole weight matrix of a bucket (a conv kernel
  reshaped to ``(out, in*kh*kw)``, as torch's hook does); vectors, and matrices too small to gain, ride along
  uncompressed. **Factor first**: the products are linear, so each rank multiplies its own gradient plus its own
  error, ``M_r``: the node-first sum of the ``P_r = M_r Q`` (kilobytes: nothing large crosses even the node's own
  wires) is orthonormalised into ``P``; the sum of the ``Q'_r = M_r^T P`` comes back on a second lane (its own
  groups and threads, so the next bucket's P need not wait), and ``P Q'^T`` replaces the matrix on every rank:
  PowerSGD of the node's sum, its error split over the node's ranks, each keeping ``M_r - P (M_r^T P)^T`` (error
  feedback); ``Q'`` starts the next step (warm start). One P and one Q per tensor. Every collective is issued by
  the pipeline's threads (under NCCL the caller's) in submission order, never from a completion callback.

Every rank orthonormalises the same summed ``P`` with the same code (identical machines, identical results); the
first ``warmup_steps`` steps go uncompressed. ``state_dict``: this rank's errors and Qs, with the layout they
belong to (``fingerprint``); a different layout resets them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from launcher.base.sync_modes import Compress
from launcher.comm import trace
from launcher.comm.sizes import mb

Stage = Callable[[torch.Tensor, Any], None]  # (a 1-D piece of a bucket, the leaders' group): reduces it in place


def plain_stage(piece: torch.Tensor, group: Any) -> None:
    dist.all_reduce(piece, group=group)


@dataclass(frozen=True)
class Matrix:
    """One parameter's gradient inside a bucket: its view (any shape) and its key (the parameter's index in the
    model, the same on every rank)."""

    view: torch.Tensor
    key: int


@dataclass
class Piece:
    """What the node-first pipeline moves: ``tensor`` through the node's reduce, the leaders' ``stage`` and the
    node's broadcast. ``prepare`` runs before the reduce (it fills ``tensor``), ``finish`` after the broadcast,
    ``abandon`` instead of ``finish`` once the pipeline failed. ``lane``: which of the topology's node-first
    lanes carries it (``Topology.add_lane``)."""

    tensor: torch.Tensor
    stage: Stage = plain_stage
    prepare: Callable[[], None] | None = None
    finish: Callable[[], None] | None = None
    abandon: Callable[[BaseException], None] | None = None
    lane: int = 0


def plain_pieces(tensor: torch.Tensor, elements: int, stage: Stage = plain_stage) -> list[Piece]:
    """``tensor`` in segments of ``elements``, each reduced by ``stage`` among the leaders."""
    return [Piece(s, stage) for s in tensor.view(-1).split(max(1, elements))]


class Compression:
    """``none``: the base. ``plan(tensor, matrices, elements)`` cuts a tensor into the pieces the pipeline moves
    (``Piece``); ``begin_step()`` once per synchronised step (the warm-up)."""

    name = Compress.none

    def __init__(self, warmup_steps: int = 0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.warmup_steps, self.steps = warmup_steps, 0

    @property
    def active(self) -> bool:
        return self.name is not Compress.none and self.steps > self.warmup_steps

    def begin_step(self) -> bool:
        """A synchronised step begins; True when compression starts with it (what crosses the link changes)."""
        self.steps += 1
        return self.name is not Compress.none and self.steps == self.warmup_steps + 1

    def plan(self, tensor: torch.Tensor, matrices: Sequence[Matrix], elements: int) -> list[Piece]:
        return plain_pieces(tensor, elements)

    def describe(self) -> str:
        return "uncompressed"

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.name.value, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> str:
        """Take over a saved state; returns why it was (partly) reset, or ""."""
        self.steps = int(state.get("steps", 0))
        return ""


class Bf16(Compression):
    name = Compress.bf16

    def plan(self, tensor: torch.Tensor, matrices: Sequence[Matrix], elements: int) -> list[Piece]:
        return plain_pieces(tensor, elements, _bf16_stage if self.active else plain_stage)

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
    name = Compress.powersgd

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
        self.lock = threading.Lock()  # the pipeline's threads write the state; a checkpoint reads it

    def compresses(self, shape: tuple[int, int] | None) -> bool:
        if shape is None:
            return False
        n, m = shape
        return min(self.rank, n, m) * (n + m) * self.min_gain <= n * m

    def plan(self, tensor: torch.Tensor, matrices: Sequence[Matrix], elements: int) -> list[Piece]:
        """The tensor's whole compressible matrices as one ``P`` and one ``Q`` piece; the rest (biases, small
        matrices) rides in P's buffer when it is at most a segment, else travels in plain segments between them."""
        if not self.active:
            return plain_pieces(tensor, elements)
        flat = tensor.view(-1)
        base, size, end = flat.data_ptr(), flat.element_size(), flat.numel()
        whole = []  # (offset, key, matrix) of each compressible matrix lying wholly in ``tensor``
        for m in matrices:
            offset, shape = (m.view.data_ptr() - base) // size, matrix_shape(m.view)
            if 0 <= offset and offset + m.view.numel() <= end and shape is not None and self.compresses(shape):
                whole.append((offset, m.key, flat[offset : offset + m.view.numel()].view(shape)))
        if not whole:
            return plain_pieces(flat, elements)
        whole.sort(key=lambda item: item[0])
        gaps, at = [], 0
        for offset, _, matrix in whole:
            gaps += [flat[at:offset]] if offset > at else []
            at = offset + matrix.numel()
        gaps += [flat[at:]] if at < end else []
        riders = gaps if sum(g.numel() for g in gaps) <= elements else []  # one collective fewer per gap
        rest = [piece for g in gaps for piece in plain_pieces(g, elements)] if not riders else []
        factors = _Factors(self, [(key, matrix) for _, key, matrix in whole], riders)
        return [factors.p_piece(), *rest, factors.q_piece()]

    def start(self, key: int, shape: tuple[int, int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This matrix's error and Q (kept transposed, ``(r, m)``: the products then run as fast row-major ones,
        4-8x the transposed ones on a CPU): kept, or new (a zero error; Q from a generator seeded by the key: the
        same on every rank)."""
        with self.lock:
            if key in self.qs and self.shapes.get(key) == shape:
                return self.errors[key], self.qs[key]
        n, m = shape
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        q_t = torch.randn(min(self.rank, n, m), m, generator=generator).to(like.device)
        return torch.zeros(n, m, dtype=like.dtype, device=like.device), q_t

    def keep(self, key: int, shape: tuple[int, int], error: torch.Tensor, q_t: torch.Tensor) -> None:
        with self.lock:
            self.errors[key], self.qs[key], self.shapes[key] = error, q_t, shape

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
            if Compress.of(state.get("mode")) is not self.name or state.get("rank") != self.rank:
                return f"saved with {state.get('mode')} rank {state.get('rank')}: errors and Qs start anew"
            for key, n, m in state.get("fingerprint", []):
                self.errors[key], self.qs[key] = state["errors"][key], state["qs"][key]
                self.shapes[key] = (n, m)
        return ""


class _Factors:
    """One tensor's compressed matrices, factor first: ``project`` (before the node's reduce) writes every
    ``P_r = M_r Q`` into one buffer; ``orthonormalise`` (after its broadcast) makes each summed P orthonormal;
    ``transpose`` (before the second reduce, once P is back) writes every ``Q'_r = M_r^T P`` into a second buffer
    and keeps the error; ``rebuild`` (after its broadcast) writes ``P Q'^T`` over each matrix."""

    def __init__(self, owner: PowerSGD, matrices: list[tuple[int, torch.Tensor]], riders: list[torch.Tensor]) -> None:
        """``riders``: uncompressed parts of the tensor that travel summed behind the P factors."""
        self.owner, self.matrices, self.riders = owner, matrices, riders
        self.states = [owner.start(key, (m.shape[0], m.shape[1]), m) for key, m in matrices]
        like = matrices[0][1]
        factors = sum(m.shape[0] * q.shape[0] for (_, m), (_, q) in zip(matrices, self.states))
        self.p = like.new_empty(factors + sum(r.numel() for r in riders))
        self.tail = self.p[factors:]
        self.q = like.new_empty(sum(q.numel() for _, q in self.states))
        self.ready = threading.Event()  # P is summed and orthonormal (or failed: ``self.failed``)
        self.failed: BaseException | None = None

    def _views(self, buffer: torch.Tensor, transposed: bool) -> list[torch.Tensor]:
        views, at = [], 0
        for (_, m), (_, q_t) in zip(self.matrices, self.states):
            rows, cols = (q_t.shape[0], m.shape[1]) if transposed else (m.shape[0], q_t.shape[0])
            views.append(buffer[at : at + rows * cols].view(rows, cols))
            at += rows * cols
        return views

    def p_piece(self) -> Piece:
        return Piece(self.p, prepare=self.project, finish=self.orthonormalise, abandon=self.abandon)

    def q_piece(self) -> Piece:
        return Piece(self.q, prepare=self.transpose, finish=self.rebuild, abandon=self.abandon, lane=1)

    def project(self) -> None:
        with trace.span("compress", "powersgd P", mb=round(mb(self.p), 3)):
            for (_, m), (error, q_t), p in zip(self.matrices, self.states, self._views(self.p, False)):
                m.add_(error)
                p.copy_(torch.mm(q_t, m.t()).t())
            if self.riders:
                torch.cat(self.riders, out=self.tail)

    def orthonormalise(self) -> None:
        for p in self._views(self.p, False):
            p.copy_(torch.linalg.qr(p).Q)
        for rider, summed in zip(self.riders, self.tail.split([r.numel() for r in self.riders])):
            rider.copy_(summed)
        self.ready.set()

    def abandon(self, exc: BaseException) -> None:
        self.failed = exc
        self.ready.set()

    def transpose(self) -> None:
        self.ready.wait()
        if self.failed is not None:
            raise RuntimeError("PowerSGD: the sum of P failed") from self.failed
        with trace.span("compress", "powersgd Q", mb=round(mb(self.q), 3)):
            for (_, m), (error, _), p, q_t in zip(
                self.matrices, self.states, self._views(self.p, False), self._views(self.q, True)
            ):
                torch.mm(p.t(), m, out=q_t)  # this rank's share of Q'^T
                torch.addmm(m, p, q_t, alpha=-1, out=error)  # what it does not send: M_r - P (M_r^T P)^T

    def rebuild(self) -> None:
        with trace.span("compress", "powersgd rebuild", mb=round(mb(self.q), 3)):
            for (key, m), (error, _), p, q_t in zip(
                self.matrices, self.states, self._views(self.p, False), self._views(self.q, True)
            ):
                torch.mm(p, q_t, out=m)
                self.owner.keep(key, (m.shape[0], m.shape[1]), error, q_t.clone())


def build_compression(mode: Compress | str, rank: int = 4, warmup_steps: int = 0, seed: int = 0) -> Compression:
    kind = Compress.of(mode)
    if kind is Compress.bf16:
        return Bf16(warmup_steps)
    if kind is Compress.powersgd:
        return PowerSGD(rank, warmup_steps, seed)
    if kind is Compress.none:
        return Compression()
    raise ValueError(f"compress={str(mode)!r} is not one of none, bf16, powersgd")  # (auto: the plan resolves it)
