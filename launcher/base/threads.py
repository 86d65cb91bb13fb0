"""Threads per rank, as torchrun sets them but without its blunt 1: each rank gets ``cores of its machine / ranks on
its machine`` threads (at least 1), through ``OMP_NUM_THREADS`` and ``torch.set_num_threads``, in every mode and
entry, ``script=`` included. Without it every rank of a machine runs as many threads as the machine has cores, and
they fight: a 2-rank DDP script ran 1.85x slower than under torchrun, a simulated job of 2 nodes ~10x.

What says otherwise, first wins: ``train.threads_per_rank``; ``OMP_NUM_THREADS`` in the rank's environment (the
user's, or torchrun's 1). The ranks "on the machine" are the node's (``local_world_size``), or, where several
simulated nodes share one machine, all of them (``RANKS_ON_MACHINE``, set by the sim head). The cores are the ones
this process may run on (its CPU affinity: a Slurm task's cgroup, ``taskset``), not the machine's count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

RANKS_ON_MACHINE = "LAUNCHER_RANKS_ON_MACHINE"


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def choose_threads(configured: Optional[int], ranks_on_machine: int, environ: Mapping[str, str]) -> tuple[int, str]:
    """(threads per rank, why): ``train.threads_per_rank``, else ``OMP_NUM_THREADS``, else cores / ranks."""
    if configured:
        return configured, "train.threads_per_rank"
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given), "OMP_NUM_THREADS"
    cores, ranks = usable_cores(), max(1, ranks_on_machine)
    return max(1, cores // ranks), f"{cores} core(s) / {ranks} rank(s) on the machine"


def ranks_on_machine(local_world_size: int, environ: Mapping[str, str]) -> int:
    shared = environ.get(RANKS_ON_MACHINE, "")
    return int(shared) if shared.isdigit() and int(shared) > 0 else local_world_size


def for_this_rank(configured: Optional[int], local_world_size: int) -> tuple[int, str]:
    """In a rank, before its work (the trainer, or the user's script): the rank's threads, also set as
    ``OMP_NUM_THREADS`` for what reads it later (a library the script imports, processes it starts); the caller
    sets torch's (``torch.set_num_threads``: this module stays torch-free for the head)."""
    threads, why = choose_threads(configured, ranks_on_machine(local_world_size, os.environ), os.environ)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads, why


def plan_line(configured: Optional[int], ranks_on_machine: int | None, environ: Mapping[str, str]) -> str:
    """The plan's line; ``ranks_on_machine`` None: the ranks run on other machines (ssh, Slurm), each decides."""
    if configured or ranks_on_machine is not None or environ.get("OMP_NUM_THREADS"):
        threads, why = choose_threads(configured, ranks_on_machine or 1, environ)
        return f"{threads} per rank ({why})"
    return "cores of each machine / its ranks (train.threads_per_rank or OMP_NUM_THREADS to set)"
