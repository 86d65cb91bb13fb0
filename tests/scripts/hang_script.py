"""A torchrun-style user script that goes wrong on purpose (the watch's tests): ``HANG_CASE`` says how.

- ``stuck``: rank ``HANG_RANK`` blocks in its own code (``time.sleep``) after five all_reduce calls;
- ``skip``: rank ``HANG_RANK`` skips the sixth all_reduce and goes on to the final barrier;
- ``op``: rank ``HANG_RANK`` broadcasts where the others all_reduce (same sizes: gloo does not notice);
- ``shape``: rank ``HANG_RANK`` all_reduces a tensor of another size at the sixth step;
- ``slow``: rank ``HANG_RANK`` computes ``HANG_FACTOR`` times longer per step from step ``HANG_FROM`` on;
- ``pauses``: every rank pauses together (no hang: nobody waits for anybody);
- ``busy``: rank ``HANG_RANK`` works ``HANG_PAUSE_S`` in its own code at the sixth step (a checkpoint, an
  evaluation) while the others wait, then goes on (a warning, not a failure);
- ``clean``: nothing goes wrong.
Every rank writes ``<HANG_MARK>.<rank>`` when it reaches the fault (so a test waits for it, not for a time).
"""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

CASE = os.environ.get("HANG_CASE", "clean")
CULPRIT = int(os.environ.get("HANG_RANK", "1"))
STEPS = int(os.environ.get("HANG_STEPS", "10"))


def mark(rank: int) -> None:
    if os.environ.get("HANG_MARK"):
        Path(f"{os.environ['HANG_MARK']}.{rank}").touch()


def stuck_in_user_code() -> None:
    while True:
        time.sleep(1)


def compute(seconds: float) -> None:
    """A step's work, slept: a busy loop needs a core for the whole step, and on a loaded box (CI's two workers on
    two cores) the scheduler then made a rank that was never slowed late by a whole step's share (CI, stop 55)."""
    time.sleep(seconds)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    grad = torch.ones(1000)
    for step in range(STEPS):
        if step == 5 and rank == CULPRIT and CASE in ("stuck", "skip", "op"):
            mark(rank)
            if CASE == "stuck":
                stuck_in_user_code()
            if CASE == "skip":
                continue
        if step == 5 and (CASE == "pauses" or (CASE == "busy" and rank == CULPRIT)):
            time.sleep(float(os.environ.get("HANG_PAUSE_S", "5")))
        slow = CASE == "slow" and rank == CULPRIT and step >= int(os.environ.get("HANG_FROM", "0"))
        compute(
            float(os.environ.get("HANG_STEP_S", "0.01")) * (float(os.environ.get("HANG_FACTOR", "2")) if slow else 1)
        )
        if step == 5 and CASE == "op" and rank == CULPRIT:
            dist.broadcast(grad, src=0)
        elif step == 5 and CASE == "shape" and rank == CULPRIT:
            mark(rank)
            dist.all_reduce(torch.ones(999))
        else:
            dist.all_reduce(grad)
    if CASE in ("skip",) and rank != CULPRIT:
        mark(rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
