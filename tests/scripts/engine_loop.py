"""A user's own training loop through ``launcher.Engine`` (docs/your-loop.md's complete example): a small MLP on
a generated classification set, the global batch split over the ranks, a checkpoint every ``--save-every`` steps and
at a stop signal, resumed when run again with the same run dir. Run it under the launcher
(``python -m launcher script=tests/scripts/engine_loop.py -- OUT``, ``comm.*`` / ``train.*`` on the command line reach
the engine) or under plain torchrun. Writes ``OUT/losses-<rank>.txt`` (each step's global-batch loss on rank 0) and
``OUT/final.pt`` (rank 0: the whole model's weights)."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import launcher

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=32)  # the GLOBAL batch
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--run-dir", default=None)  # under plain torchrun (the launcher's own run dir otherwise)
parser.add_argument("--compress", default=None)  # none | bf16 | powersgd | auto (else: the job's comm.compress)
args = parser.parse_args()

g = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(args.samples, 16, generator=g), torch.randint(0, 4, (args.samples,), generator=g))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

overrides = {key: value for key, value in (("run_dir", args.run_dir), ("compress", args.compress)) if value}
engine = launcher.Engine(**overrides)
model, optimizer = engine.setup(model, optimizer)
loader = engine.loader(dataset, batch_size=args.batch_size, shuffle=True)
extra = engine.resume()  # {} on a fresh start; else the dict the last save was given
args.out.mkdir(parents=True, exist_ok=True)
losses = open(args.out / f"losses-{engine.rank}.txt", "a")
for epoch in range(engine.epoch, args.epochs):
    for x, y in loader:
        with engine.step():
            loss = F.cross_entropy(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)  # (the global batch's loss, for the record)
        print(f"{engine.global_step} {mean.item() / engine.world_size:.8f}", file=losses, flush=True)
    engine.save({"epochs_done": epoch + 1})
weights = engine.model_state_dict()
if engine.is_main:
    torch.save(weights, args.out / "final.pt")
print(f"rank {engine.rank}: {engine.global_step} steps, resumed from {extra or 'nothing'}", file=sys.stderr)
engine.close()
