"""A sharded job's checkpoints (``comm.reducer=fsdp``): no rank ever holds the whole model or optimiser state, so
none gathers it to write it. Every rank writes its own shards with torch.distributed.checkpoint (DCP) into one
directory, ``checkpoints/step-XXXXXXXX/`` (names in ``launcher.base.checkpoint_names``):

- ``__<rank>_0.distcp``: DCP's data: the rank's shards of ``{"model": ..., "optim": ...}`` as ``get_state_dict``
  gives them (DTensors under the plain model's names); a shard held on several nodes (``comm.shard=node``) is
  written once.
- ``.metadata``: DCP's index, written last by its coordinator once every rank's data is in.
- ``train.pt`` (+ ``.sha256``): rank 0's: the training state but the model and optimiser (schedule, stepper,
  position, world size, the sync's choices, config): what the run reads first to decide how to resume.
- ``own-<k>.pt`` (+ ``.sha256``): rank k's own: its RNG state, its part of the log window and its compression
  state (its shard's error feedback: gathered, it would be the whole model's size).

It is written as ``step-XXXXXXXX.tmp/`` and renamed by rank 0 once every part is in (DCP's paths inside are
relative: the renamed directory loads), so a write cut short is never taken for a checkpoint. Loading reads only
what this rank holds: its shards into the sharded model and optimiser in place (the same layout of ranks gives back
every bit; on another, DCP reads each new shard from the saved chunks it overlaps), or, into a replicated job's
plain model, every chunk (``launcher.train.reshard``). DCP wants a file system every rank sees (one host's, or a
shared one, as for a run dir)."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from launcher.base.checkpoint_names import REPLACED, TRAIN_STATE, WRITING, rank_state
from launcher.group.helpers import Peers
from launcher.train import checkpoint as ckpt
from launcher.train.dcp_index import IndexReader
from launcher.train.optim import as_built

PER_RANK = ("rng", "log_window", "compression")  # what each rank writes of its own (``own-<k>.pt``)
Failure = tuple[int, Optional[int], str]  # a rank that could not write: (rank, errno: None if not the system's, why)


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    peers: Peers,
    rank: int,
    own: dict[str, Any],
    train: Optional[dict[str, Any]] = None,
) -> None:
    """Collective: every rank writes its shards and ``own`` part (rank 0 the ``train`` state too) into ``path`` +
    ``.tmp``, then rank 0 renames it ``path``. A rank that cannot write (a full disk) makes every rank raise the
    same ``OSError``, naming that rank (any other failure: a ``RuntimeError`` with DCP's report); the half-written
    directory is removed."""
    writing = path.with_name(path.name + WRITING)
    failed = [f for f in peers.all_gather_object(_write_parts(writing, rank, own, train)) if f is not None]
    _raise_failed(failed or _write_shards(writing, model, optimizer, rank, peers), writing, rank)
    if rank == 0:
        _commit(writing, path)


def _raise_failed(failed: list[Failure], writing: Path, rank: int) -> None:
    """Every rank, when any could not write: the half-written directory removed (rank 0), the first failure raised
    (an ``OSError`` naming the rank, or DCP's report)."""
    if not failed:
        return
    if rank == 0:
        ckpt.remove(writing)
    at, errno, why = failed[0]
    if errno is None:
        raise RuntimeError(f"torch.distributed.checkpoint could not write {writing}: rank {at}: {why}")
    raise OSError(errno, f"{why} (rank {at})")


def save_async(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    peers: Peers,
    rank: int,
    own: dict[str, Any],
    train: Optional[dict[str, Any]],
    stager: Any,
    group: Any,
) -> Callable[[], None]:
    """``save``'s ``train.checkpoint_async``: the small parts written as there (collective), the shards staged by
    ``stager`` (kept buffers: the previous write must be done) and handed to DCP's ``async_save`` on ``group`` (a
    gloo group of its own: its planning collectives must never meet the training's in another order); returns
    what finishes it on the writer thread (the shards written, then rank 0's rename)."""
    writing = path.with_name(path.name + WRITING)
    _raise_failed(
        [f for f in peers.all_gather_object(_write_parts(writing, rank, own, train)) if f is not None], writing, rank
    )
    msd, osd = get_state_dict(model, optimizer)
    writer = FileSystemWriter(writing)
    writer.fs = _Disk()
    response = dcp.async_save(
        {"model": msd, "optim": osd}, storage_writer=writer, process_group=group, async_stager=stager
    )
    done: Any = getattr(response, "upload_completion", response)  # (torch 2.13: an AsyncSaveResponse with a stager)

    def finish() -> None:
        try:
            done.result()
        except CheckpointException as exc:
            kept = writer.fs.errors  # type: ignore[attr-defined]  # a full disk: the OSError it hit
            if kept:
                raise OSError(kept[0].errno, f"{kept[0].strerror or kept[0]} (rank {rank})") from exc
            raise
        if rank == 0:
            _commit(writing, path)

    return finish


def _write_parts(writing: Path, rank: int, own: dict[str, Any], train: Optional[dict[str, Any]]) -> Optional[Failure]:
    """This rank's own file (rank 0's ``train.pt`` too), checksummed; what went wrong, or None."""
    try:
        writing.mkdir(parents=True, exist_ok=True)
        ckpt.save_atomic(own, rank_state(writing, rank))
        if train is not None:
            ckpt.save_atomic(train, writing / TRAIN_STATE)
    except OSError as exc:
        return rank, exc.errno, exc.strerror or str(exc)
    return None


def _write_shards(
    writing: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, peers: Peers
) -> list[Failure]:
    """DCP's collective save into ``writing`` (``.metadata`` exists once it returns, on every rank); the ranks that
    failed (every rank gets DCP's failure): each rank's own ``OSError`` (``_Disk``), gathered, else DCP's report."""
    disk = _Disk()
    writer = FileSystemWriter(writing)
    writer.fs = disk
    try:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
        return []
    except CheckpointException as exc:
        mine = next(((rank, e.errno, e.strerror or str(e)) for e in disk.errors), None)
        failed = [f for f in peers.all_gather_object(mine) if f is not None]
        errors = sorted((r, e) for r, (e, _) in exc.failures.items())
        said = [(r, e.errno if isinstance(e, OSError) else None, str(e).splitlines()[0]) for r, e in errors]
        return failed or said


class _Disk(FileSystem):
    """DCP's file system, keeping the ``OSError`` a write hit (a full disk): DCP writes each tensor with
    torch.save, which reports a failed write only as "unexpected pos"."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            yield cast(io.IOBase, _Kept(stream, self.errors))


class _Kept:
    """A file stream whose failed writes are kept in ``errors`` (then raised as they are)."""

    def __init__(self, stream: io.IOBase, errors: list[OSError]) -> None:
        self.stream, self.errors = stream, errors

    def write(self, data: Any) -> int:
        return self._kept(self.stream.write, data)

    def flush(self) -> None:
        self._kept(self.stream.flush)

    def _kept(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as exc:
            self.errors.append(exc)
            raise

    def __getattr__(self, name: str) -> Any:  # tell, fileno, close: the stream's own
        return getattr(self.stream, name)


def _commit(writing: Path, path: Path) -> None:
    """Rank 0, once every part is in: ``writing`` becomes ``path`` (one written before at this step, by a run that
    resumed from an earlier checkpoint, is replaced: moved aside first, so a crash leaves one or the other whole)."""
    old = path.with_name(path.name + REPLACED)
    if path.exists():
        ckpt.remove(old)
        path.rename(old)
    writing.rename(path)
    ckpt.remove(old)


def load_shards(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank reads into ``model`` and ``optimizer`` in place what they hold of ``path``: a sharded
    model its shards, of whatever layout wrote them (DCP reshards: each rank's ``get_state_dict`` says which part of
    each tensor it holds), a plain one the whole tensors (the optimiser built as this run built it:
    ``optim.as_built``)."""
    msd, osd = get_state_dict(model, optimizer)  # (an optimiser without state yet: DCP's zero step makes it)
    dcp.load({"model": msd, "optim": osd}, storage_reader=IndexReader(path))  # (in place; the index read safely)
    with as_built(optimizer):
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def own_view(path: Path, state: dict[str, Any], rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """``train.pt``'s ``state`` as rank ``rank`` resumes from it: with its own part (``own-<k>.pt``) in the per-rank
    lists a file checkpoint holds (``rng``, ``log_window``, ``compression``, at its place; the other places None,
    the other ranks' to read), on the same world size; on another, none (every rank starts its streams afresh,
    as from a file checkpoint of another world size; a compression state starts anew: ``train.pt``'s
    ``compressed`` says there was one)."""
    if state.get("world_size") != world_size:
        return state
    own = ckpt.read(rank_state(path, rank), map_location=device)
    lists: dict[str, list[Any]] = {}
    for key in PER_RANK:
        if own.get(key) is not None:
            lists[key] = [None] * world_size
            lists[key][rank] = own[key]
    return {**state, **lists}
