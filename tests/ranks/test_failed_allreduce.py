"""A failed allreduce fails the future our comm hooks hand to DDP (docs/healing.md: a bug healing found, fixed for
every job): its ``then`` callback handed on the unreduced tensor as if reduced. On 2 real gloo ranks, rank 1 leaves
after a barrier; rank 0's ``flat_allreduce`` (every hook's flat path) must raise, not return its own gradient."""

import os
from pathlib import Path

import torch
import torch.distributed as dist

from harness.ranks import spawn_ranks


def _lose_a_peer(rank, world, out_dir):
    from launcher.comm.collectives import flat_allreduce

    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone: its pair with rank 0 closes
    grad = torch.full((1000,), 3.0)
    try:
        flat_allreduce(grad).wait()
        said = "returned " + str(float(grad[0]))
    except RuntimeError as exc:
        said = "raised " + type(exc).__name__
    Path(out_dir, "said").write_text(said)


def test_an_allreduce_that_failed_fails_the_hooks_future(tmp_path):
    spawn_ranks(_lose_a_peer, 2, tmp_path)
    assert (tmp_path / "said").read_text() == "raised RuntimeError"
