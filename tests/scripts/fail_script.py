"""A torchrun-style script in which one rank raises: ``fail_script.py WHERE RANK``.

WHERE: ``before`` the first collective (right after init), ``between`` two collectives, or ``inside`` one (the
failing rank starts an allreduce its peers are waiting in, then raises instead of finishing it)."""

import os
import sys

import torch
import torch.distributed as dist

where, failing = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
if where == "before" and rank == failing:
    raise RuntimeError(f"boom before the first collective on rank {rank}")
dist.barrier()
if where == "between" and rank == failing:
    raise RuntimeError(f"boom between collectives on rank {rank}")
data = torch.ones(1 << 20)
work = dist.all_reduce(data, async_op=True)
if where == "inside" and rank == failing:
    raise RuntimeError(f"boom inside a collective on rank {rank}")
work.wait()
dist.barrier()
dist.destroy_process_group()
