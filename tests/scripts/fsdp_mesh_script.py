"""An FSDP2 training script of the kind docs/running.md shows, on the launcher's mesh: ``launcher.mesh()`` (HSDP:
shard inside a node, replicate across nodes) or ``--flat`` (``launcher.mesh(shard="world")``). Each rank trains on its
share of one fixed global batch; rank 0 writes the losses to ``--out`` (JSON)."""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import launcher

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--flat", action="store_true")
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()

dist.init_process_group("gloo")
mesh = launcher.mesh(shard="world" if args.flat else "node")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)], torch.nn.Linear(32, 4))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
mine = slice(rank * 64 // world, (rank + 1) * 64 // world)
losses = []
for _ in range(args.steps):
    loss = torch.nn.functional.cross_entropy(model(inputs[mine]), targets[mine])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / world)
if rank == 0:
    names = mesh.mesh_dim_names
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "dims": list(names), "shape": list(mesh.shape)}, f)
dist.destroy_process_group()
