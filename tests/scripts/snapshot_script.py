"""A torchrun-style DDP script that survives restarts by its own snapshots, in the shape of PyTorch's DDP tutorial
(multinode.py), on the CPU with gloo: every ``--save-every`` epochs rank 0 saves a snapshot (the model, the optimizer,
the epochs run) to ``--snapshot``; at start every rank resumes from it when it exists ("Resuming training from
snapshot at Epoch N": N epochs done, training goes on with epoch N). At the end rank 0 writes the model to
``--final``. A fault hook for the tests: ``--kill-rank R --kill-epoch E`` SIGKILLs rank R at the start of epoch E, on
the first attempt only (TORCHELASTIC_RESTART_COUNT 0): the launcher (``cluster.max_restarts``) starts the ranks
again and they resume. docs/running.md shows it.

    python -m launcher script=tests/scripts/snapshot_script.py cluster.max_restarts=1 -- 6 --snapshot S.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def dataset(samples: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(samples, 20, generator=g)
    return TensorDataset(inputs, inputs @ torch.randn(20, 1, generator=g))


class Trainer:
    def __init__(self, data: DataLoader, snapshot_path: str, save_every: int) -> None:
        self.rank = int(os.environ["RANK"])
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # 0, then 1 after a restart...
        torch.manual_seed(0)
        model = torch.nn.Linear(20, 1)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.data, self.snapshot_path, self.save_every = data, snapshot_path, save_every
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot(model)
        self.model = DDP(model)

    def _load_snapshot(self, model: torch.nn.Module) -> None:
        snapshot = torch.load(self.snapshot_path, map_location="cpu")
        model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        partial = f"{self.snapshot_path}.partial"  # written whole, then renamed: a kill mid-save leaves the old one
        torch.save(snapshot, partial)
        os.replace(partial, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def _run_epoch(self, epoch: int) -> None:
        self.data.sampler.set_epoch(epoch)  # the same order whichever attempt runs this epoch
        for inputs, targets in self.data:
            self.optimizer.zero_grad()
            F.mse_loss(self.model(inputs), targets).backward()
            self.optimizer.step()
        print(f"[rank {self.rank}] Epoch {epoch} | Steps: {len(self.data)} | attempt {self.attempt}", flush=True)

    def train(self, max_epochs: int, kill_rank: int, kill_epoch: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            if self.attempt == 0 and self.rank == kill_rank and epoch == kill_epoch:  # the fault, first attempt only
                print(f"[rank {self.rank}] killing myself at epoch {epoch}", flush=True)
                os.kill(os.getpid(), 9)
            self._run_epoch(epoch)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("--snapshot", required=True, help="the snapshot's path (every rank reads it)")
    parser.add_argument("--save-every", type=int, default=2, help="epochs between snapshots")
    parser.add_argument("--final", default="", help="where rank 0 writes the trained model at the end")
    parser.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself on attempt 0 ...")
    parser.add_argument("--kill-epoch", type=int, default=-1, help="... at the start of this epoch")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    train_set = dataset()
    data = DataLoader(train_set, batch_size=8, sampler=DistributedSampler(train_set, shuffle=True, seed=0))
    trainer = Trainer(data, args.snapshot, args.save_every)
    trainer.train(args.total_epochs, args.kill_rank, args.kill_epoch)
    if trainer.rank == 0 and args.final:
        torch.save(trainer.model.module.state_dict(), args.final)
    dist.barrier()  # every rank done before any leaves
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
