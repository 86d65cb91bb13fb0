"""bench/heal_loop.py's loop through ``launcher.Engine``: ``heal_loop_job.py STEPS [BATCH]``, run as a launcher job
(``python -m launcher +cluster=sim ... script=bench/heal_loop_job.py -- STEPS BATCH``). The built-in trainer's
default model (``models.lenet.LeNet``, 28x28 inputs) on a fixed synthetic data set of about the digits' size (the
same on any number of ranks), SGD with momentum, a global batch of BATCH (default 48), no checkpoint in the loop:
the same work per step as the trainer the bench runs beside it. Every rank prints one line per completed step
(``step.done``) with the wall time it completed: ``rank R: step S on W ranks at T`` (T: ``time.time()``, what the
bench reads)."""

import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import launcher
from models.lenet import LeNet

steps, batch = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 48
generator = torch.Generator().manual_seed(0)
inputs = torch.randn(batch * max(2, 1440 // batch), 1, 28, 28, generator=generator)  # about digits' size
labels = (inputs.flatten(1) @ torch.randn(28 * 28, 10, generator=generator)).argmax(1)
torch.manual_seed(0)
model = LeNet(in_channels=1, num_classes=10, image_size=28)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

engine = launcher.Engine(checkpoint_every_steps=0)
model, optimizer = engine.setup(model, optimizer)
loader = engine.loader(TensorDataset(inputs, labels), batch_size=batch)
engine.resume()  # nothing to read in a fresh run dir (the bench counts any "resumed from")
while engine.global_step < steps:
    for x, y in loader:
        with engine.step() as step:
            engine.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        if step.done:
            print(
                f"rank {engine.rank}: step {engine.global_step} on {engine.world_size} ranks at {time.time():.4f}",
                flush=True,
            )
        if engine.global_step >= steps:
            break
engine.close()
