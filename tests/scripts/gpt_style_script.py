"""A training script of the shape public GPT trainers have (written here for the tests): ``--key=value`` arguments
(argparse), the training log printed by rank 0 only, warnings on stderr by every rank, the process group its own.
``--die_after=K``: rank 0 kills itself with SIGKILL after its K-th line (what it printed must be in its log)."""

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--iters", type=int, default=3)
parser.add_argument("--lr", type=float, default=6e-4)
parser.add_argument("--die_after", type=int, default=-1)
parser.add_argument("--tag", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
loss = torch.tensor([4.0 + rank])
for it in range(args.iters):
    dist.all_reduce(loss)
    loss /= world
    if rank == 0:
        print(f"iter {it}: loss {loss.item():.4f}, lr {args.lr:g} {args.tag}".rstrip())
    print(f"rank {rank} warning at iter {it}", file=sys.stderr)
    if rank == 0 and it == args.die_after:
        os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
dist.destroy_process_group()
