"""The loop through ``launcher.Engine`` as a launcher job, timed as the built-in trainer times itself: your_loop.py
runs it beside the trainer on the same settings (``python -m launcher +cluster=sim ... script=bench/engine_job.py
comm.compress=X -- OUT.json``). The trainer's ``model=mlp model.hidden=1024 model.depth=6`` on ``data=synthetic``-like
inputs, the optimizer the trainer builds (fused SGD with momentum), a global batch of ``--batch`` samples; rank 0
times each window of ``--window`` steps (wall time, as the trainer's ``samples_per_s``) and writes the windows'
samples/s to OUT.json."""

import argparse
import json
import time

import torch
import torch.nn.functional as F

import launcher
from models.mlp import MLP

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=128)
parser.add_argument("--window", type=int, default=5)
args = parser.parse_args()

g = torch.Generator().manual_seed(0)
x = torch.randn(args.steps * args.batch, 1, 28, 28, generator=g)
dataset = torch.utils.data.TensorDataset(x, (x.flatten(1) @ torch.randn(28 * 28, 10, generator=g)).argmax(1))
torch.manual_seed(0)
model = MLP(in_channels=1, image_size=28, num_classes=10, hidden=1024, depth=6)

engine = launcher.Engine(checkpoint_every_steps=0)  # the rest: the job's comm.* as the command line set them
model, optimizer = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True))
windows, started = [], time.perf_counter()
for x, y in engine.loader(dataset, batch_size=args.batch, shuffle=True):
    with engine.step():
        engine.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    if engine.global_step % args.window == 0:
        now = time.perf_counter()
        windows.append({"step": engine.global_step, "samples_per_s": args.window * args.batch / (now - started)})
        started = now
if engine.is_main:
    assert engine.sync is not None
    with open(args.out, "w") as f:
        json.dump({"windows": windows, "sync": engine.sync.description}, f)
engine.close()
