"""An accelerate loop with the launcher's node-first hook (docs/comm-hook.md), trained three ways in one process, each
from the same initial weights on the same batches: without a hook (the reference), then with ``comm_hook("bf16")`` and
``comm_hook("powersgd")`` registered on the DDP model ``accelerator.prepare`` returns. Rank 0 writes each run's final
loss, weights and what the hook saw to ``--out``.

    python -m launcher +cluster=sim cluster.nodes=2 cluster.procs_per_node=1 script=tests/scripts/accelerate_hook.py \
        -- --out OUT.pt                                   # also: torchrun / accelerate launch ... this script"""

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import launcher

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

accelerator = Accelerator(cpu=True)  # makes the process group from the launcher's (torchrun's) variables


def train(compress):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32 * args.steps, 32, generator=g)
    loader = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)  # 16 a rank: prepare shards it
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = None
    if compress is not None:
        state, hook = launcher.comm_hook(compress, compress_warmup_steps=2)
        model.register_comm_hook(state, hook)  # model: the DDP module prepare made
    losses = []
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    mean = torch.tensor(losses[-3:]).mean()
    dist.all_reduce(mean)
    seen = None
    if state is not None:
        seen = {"buckets": state.buckets, "steps": state.compression.steps, "describe": state.describe()}
        state.close()
    weights = accelerator.unwrap_model(model).state_dict()
    return {"loss": mean.item() / dist.get_world_size(), "first_loss": losses[0], "weights": weights, "hook": seen}


results = {"reference": train(None), "hook-bf16": train("bf16"), "hook-powersgd": train("powersgd")}
results["world"] = dist.get_world_size()
results["wrapped"] = type(accelerator.prepare(nn.Linear(2, 2))).__name__
if dist.get_rank() == 0:
    torch.save(results, args.out)
accelerator.wait_for_everyone()
