"""The one place that turns torch's errors into ours (``group.failed.typed_errors``) against real gloo ranks: the
words gloo says when a peer is gone, or when a collective gives up waiting, are in the table (``TORCH_SAYS``), so a
survivor's error becomes ``CollectiveFailed`` / ``CollectiveTimedOut`` raised from gloo's own, on the plain
collective and through our comm hooks' future (torch's callback wrapper) alike; the error of the user's code
around it passes unchanged."""

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from harness.ranks import spawn_ranks


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__} from {type(exc.__cause__).__name__}"


def _lose_a_peer(rank, world, out_dir, how):
    from launcher.comm.collectives import flat_allreduce
    from launcher.group.failed import typed_errors

    dist.barrier()
    if rank == 1:
        os._exit(0)  # gone: its pair with rank 0 closes
    grad = torch.full((1000,), 3.0)
    try:
        with typed_errors():
            if how == "hook":
                flat_allreduce(grad).wait()  # our hooks' future: torch wraps the failed callback's error
            else:
                dist.all_reduce(grad)
    except Exception as exc:  # noqa: BLE001 - what left the one place
        Path(out_dir, "said").write_text(_said(exc))


def test_a_lost_peers_collective_error_becomes_ours(tmp_path):
    for how in ("plain", "hook"):
        (tmp_path / "said").unlink(missing_ok=True)
        spawn_ranks(_lose_a_peer, 2, tmp_path, how)
        assert (tmp_path / "said").read_text() == "CollectiveFailed from RuntimeError", how


def _time_out(rank, world, out_dir):
    from launcher.group.failed import typed_errors

    short = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    done = Path(out_dir, "said")
    if rank == 1:  # never reaches the collective: rank 0's gives up after 2 s
        while not done.exists():
            time.sleep(0.05)
        return
    try:
        with typed_errors():
            dist.all_reduce(torch.ones(4), group=short)
    except Exception as exc:  # noqa: BLE001 - what left the one place
        done.write_text(_said(exc))


def test_a_collective_that_gave_up_waiting_becomes_ours(tmp_path):
    spawn_ranks(_time_out, 2, tmp_path)
    assert (tmp_path / "said").read_text() == "CollectiveTimedOut from RuntimeError"


def _user_error(rank, world, out_dir):
    from launcher.group.failed import typed_errors

    try:
        with typed_errors():
            dist.all_reduce(torch.ones(4))
            torch.ones(4, 3) @ torch.ones(5, 2)  # the user's shape mismatch: torch's RuntimeError, not a collective's
    except RuntimeError as exc:
        frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)]  # none of the one place's
        Path(out_dir, f"said-{rank}").write_text(f"{type(exc).__name__} {exc.__cause__} {frames}")


def test_the_users_error_beside_collectives_passes_unchanged(tmp_path):
    spawn_ranks(_user_error, 2, tmp_path)
    for rank in range(2):
        assert (tmp_path / f"said-{rank}").read_text() == "RuntimeError None ['_user_error']"
