"""A Lightning script with the launcher's node-first hook (docs/comm-hook.md), trained several ways in one process,
each from the same initial weights on the same data: without a hook (the reference), with ``comm_hook(bf16)`` and
``comm_hook(powersgd)`` registered by a Callback at ``on_fit_start`` (Lightning has wrapped the model in DDP by then,
on any device, under any launcher), and with ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` (which Lightning
2.x registers only on CUDA). Rank 0 writes each run's final loss, weights and what the hook saw to ``--out``.

    python -m launcher +cluster=sim cluster.nodes=2 cluster.procs_per_node=1 script=tests/scripts/lightning_hook.py \
        -- --out OUT.pt                                   # the launcher's ranks (also: torchrun ... this script)
    NODE_RANK=K MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/scripts/lightning_hook.py --own --devices 1 \
        --nodes 2 --out OUT.pt                            # Lightning's own launcher, one command per node K"""

import argparse

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import launcher

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--own", action="store_true", help="Lightning's own launcher makes the ranks and the group")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--nodes", type=int, default=1)
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.losses: list[float] = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class NodeFirst(L.Callback):
    """Registers ``launcher.comm_hook`` on the DDP model Lightning made (the group exists by ``on_fit_start``)."""

    def __init__(self, compress: str) -> None:
        self.compress, self.state = compress, None

    def on_fit_start(self, trainer, pl_module):
        self.state, hook = launcher.comm_hook(self.compress, compress_warmup_steps=2)
        trainer.strategy.model.register_comm_hook(self.state, hook)

    def on_fit_end(self, trainer, pl_module):
        self.state.close()


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32 * args.steps, 32, generator=g)
    y = x[:, :4].argmax(1)  # learnt within the steps
    return DataLoader(TensorDataset(x, y), batch_size=16)  # 16 a rank: Lightning adds a DistributedSampler


def fit(strategy, callbacks=()) -> Tiny:
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=strategy, max_epochs=1,
        callbacks=list(callbacks),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data())
    return model


def seen(model: Tiny, state) -> dict:
    mean = torch.tensor(model.losses[-3:]).mean()  # the last steps' loss, averaged over ranks
    if dist.is_initialized():
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    hook = None
    if state is not None:
        hook = {"buckets": state.buckets, "steps": state.compression.steps, "describe": state.describe(),
                "source": state.topology.env.source}  # fmt: skip
    return {"loss": mean.item(), "first_loss": model.losses[0], "weights": model.net.state_dict(), "hook": hook}


if not args.own:
    dist.init_process_group("gloo")  # before the Trainer: Lightning takes the group (DDPStrategy's route needs it)
results = {"reference": seen(fit("ddp"), None)}
for compress in ("bf16", "powersgd"):
    callback = NodeFirst(compress)
    results[f"callback-{compress}"] = seen(fit("ddp", [callback]), callback.state)
if not args.own:
    state, hook = launcher.comm_hook("bf16", compress_warmup_steps=2)
    results["strategy-bf16"] = seen(fit(DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)), state)
    state.close()
results["world"] = dist.get_world_size()
if dist.get_rank() == 0:
    torch.save(results, args.out)
dist.barrier()
