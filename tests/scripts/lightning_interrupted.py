"""A Lightning script written as Lightning's docs write it, with ``OnExceptionCheckpoint``: stopped by Ctrl-C, every
rank gets the SIGINT (as under torchrun), Lightning's own graceful shutdown runs its ``on_exception`` callbacks and
the checkpoint is written. ``OUT/running`` appears once training runs (the test sends the signal then).

    python -m launcher cluster.procs_per_node=2 script=tests/scripts/lightning_interrupted.py -- OUT"""

import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

out = Path(sys.argv[1])


class Slow(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2)

    def training_step(self, batch, index):
        if index == 3 and self.global_rank == 0:
            (out / "running").touch()
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SlowData(TensorDataset):
    """Each sample takes a while to load (as real data does): most of a step is Python, where a signal acts at once.
    (Lightning's shutdown is racy where one rank is inside a collective when Ctrl-C comes and another is not: the one
    in Python raises KeyboardInterrupt and goes to the checkpoint's barrier, the other waits for its collective; under
    torchrun as under the launcher, whose grace then ends both.)"""

    def __getitem__(self, index):
        time.sleep(0.02)
        return super().__getitem__(index)


out.mkdir(parents=True, exist_ok=True)
data = DataLoader(SlowData(torch.randn(64, 8), torch.randint(0, 2, (64,))), batch_size=4)
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=100000, logger=False, enable_progress_bar=False,
    enable_model_summary=False, callbacks=[OnExceptionCheckpoint(dirpath=str(out))], default_root_dir=str(out),
)  # fmt: skip
trainer.fit(Slow(), data)
