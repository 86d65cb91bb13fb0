"""The one way to start and end a process group, and rank helpers that work without one.

Training code calls ``get_rank()``/``all_reduce(...)`` unconditionally: with no process group they return the
single-process answer, so there are no ``if distributed:`` branches anywhere else.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

from .env import DistEnv

log = logging.getLogger(__name__)


@contextlib.contextmanager
def process_group(
    env: DistEnv,
    backend: str,
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
) -> Iterator[None]:
    """Initialise the default group for ``env`` and always destroy it, whatever happens inside.

    Rendezvous through ``store`` when given (tests use a FileStore), else a TCPStore client at
    ``env.master_addr:env.master_port``; a single process uses an in-memory store (no port at all).
    """
    timeout = timedelta(seconds=timeout_s)
    if store is None and env.world_size == 1:
        store = dist.HashStore()
    if store is None:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0 and not env.agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )
    # The agent's store outlives a failed attempt: a restarted group must not read the dead ranks' addresses.
    store = dist.PrefixStore(f"launcher/attempt-{env.restart_count}", store)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    log.debug("process group up: %s backend=%s", env.describe(), backend)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # Groups still referenced from garbage cycles (DDP, reducer hooks) would otherwise be destroyed at
        # interpreter exit, while their backend threads are joinable: std::terminate (SIGABRT) after a clean run.
        gc.collect()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized() and get_world_size() > 1:
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place allreduce (``sum``/``mean``/``max``/``min``) across the default group; identity when alone."""
    if is_initialized() and get_world_size() > 1:
        if op == "mean":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(get_world_size())
        else:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))
    return tensor


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast from ``src``; identity when alone."""
    if is_initialized() and get_world_size() > 1:
        dist.broadcast(tensor, src=src)
    return tensor


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Rank ``src``'s buffers (batch-norm statistics) on every rank."""
    for buffer in module.buffers():
        broadcast_(buffer, src=src)


def all_gather_object(obj: object) -> list:
    """Every rank's ``obj``, in rank order (a one-element list when alone)."""
    if not (is_initialized() and get_world_size() > 1):
        return [obj]
    out: list = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank."""
    if not (is_initialized() and get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
