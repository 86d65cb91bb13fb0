"""A loop through ``launcher.Engine`` that the healing tests kill machines under (tests/beds/test_heal_loop.py):
``heal_loop.py STEPS OUT_DIR [reducer [outside]]`` (``outside``: a parameter changed between two steps, a mistake).
A fixed data set and model (the same on any number of ranks), SGD with momentum and a decaying learning rate (its
scheduler registered with the engine), a global batch of 48; each completed step is logged once by every rank
(``step.done``, with the time), the final model saved by the engine, and by rank 0 to OUT_DIR/model.pt whole, its
loss on the whole data set in OUT_DIR/final.json."""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import launcher

steps, out = int(sys.argv[1]), Path(sys.argv[2])
reducer = sys.argv[3] if len(sys.argv) > 3 else "ddp"
mistake = sys.argv[4] if len(sys.argv) > 4 else ""
generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1440, 16, generator=generator), torch.randint(0, 4, (1440,), generator=generator))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

engine = launcher.Engine(reducer=reducer)
model, optimizer = engine.setup(model, optimizer)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.02 * step))
engine.register(scheduler=scheduler)
loader = engine.loader(data, batch_size=48)
engine.resume()
while engine.global_step < steps:
    for x, y in loader:
        with engine.step() as step:
            loss = F.cross_entropy(model(x), y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        if mistake == "outside" and engine.global_step == 3:
            with torch.no_grad():
                next(model.parameters()).mul_(0.5)
        if step.done:
            print(f"rank {engine.rank}: step {engine.global_step} on {engine.world_size} ranks at {time.time():.3f}")
        if engine.global_step >= steps:
            break
engine.save()
whole = engine.model_state_dict()
if engine.is_main:
    final = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    final.load_state_dict(whole)
    with torch.no_grad():
        total = F.cross_entropy(final(data.tensors[0]), data.tensors[1]).item()
    (out / "final.json").write_text(json.dumps({"loss": total, "step": engine.global_step}))
    torch.save(whole, out / "model.pt")
engine.close()
