"""A Hugging Face ``Trainer`` with the launcher's node-first hook (docs/comm-hook.md). Its API has no place for a comm
hook of one's own (``TrainingArguments`` has ``ddp_bucket_cap_mb`` and friends; the accelerate ``DDP`` kwargs it
builds itself take only torch's hooks, by name), so a ``TrainerCallback`` registers it at ``on_train_begin``, when
``trainer.model_wrapped`` is the DDP model and no backward has run. Trained twice in one process from the same
initial weights on the same batches: without the hook (the reference) and with ``comm_hook("bf16")``. Rank 0 writes
each run's training loss, weights and what the hook saw to ``--out``.

    python -m launcher +cluster=sim cluster.nodes=2 cluster.procs_per_node=1 script=tests/scripts/hf_trainer_hook.py \
        -- --out OUT.pt --dir TMP                         # also: torchrun ... this script"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import launcher

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--dir", required=True, help="the Trainer's output_dir (nothing is saved there)")
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x, labels):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(32 * args.steps, 32, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.x[i, :4].argmax()}


class NodeFirst(TrainerCallback):
    """Registers ``launcher.comm_hook`` on the DDP model the Trainer made, before its first step."""

    def __init__(self, trainer: Trainer, compress: str) -> None:
        self.trainer, self.compress, self.state = trainer, compress, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.state is None:  # (a second train() keeps the hook DDP already has)
            self.state, hook = launcher.comm_hook(self.compress, compress_warmup_steps=2)
            self.trainer.model_wrapped.register_comm_hook(self.state, hook)


def train(compress):
    arguments = TrainingArguments(
        output_dir=args.dir, use_cpu=True, per_device_train_batch_size=16, max_steps=args.steps, optim="sgd",
        learning_rate=0.5, lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no",
        remove_unused_columns=False, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=Tiny(), args=arguments, train_dataset=Samples())
    callback = NodeFirst(trainer, compress) if compress else None
    if callback is not None:
        trainer.add_callback(callback)
    out = trainer.train()
    seen = None
    if callback is not None:
        state = callback.state
        seen = {"buckets": state.buckets, "steps": state.compression.steps, "describe": state.describe()}
        state.close()
    wrapped = type(trainer.model_wrapped).__name__
    return {"loss": out.training_loss, "weights": trainer.model.net.state_dict(), "hook": seen, "wrapped": wrapped}


results = {"reference": train(None), "hook-bf16": train("bf16")}
results["world"] = dist.get_world_size()
if dist.get_rank() == 0:
    torch.save(results, args.out)
dist.barrier()
