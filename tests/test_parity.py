"""A 2-rank DDP step computes the single-process full-batch gradient; 2-rank training keeps ranks identical."""

import json

import torch
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from helpers import plan, spawn_ranks
from launcher.config import freeze, load_frozen
from launcher.env import DistEnv
from launcher.train.trainer import Trainer
from models import LeNet, resnet18


def _grad_parity(rank, world, out_dir, model_name):
    torch.manual_seed(0)
    make = {"lenet": LeNet, "resnet18": lambda: resnet18(num_classes=10)}[model_name]
    model = make()
    reference = make()
    reference.load_state_dict(model.state_dict())
    if model_name == "resnet18":  # batch norm: compare in eval mode, where a shard's statistics don't matter
        model.eval()
        reference.eval()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 28, 28, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    shard = slice(rank * 16 // world, (rank + 1) * 16 // world)
    F.cross_entropy(ddp(x[shard]), y[shard]).backward()
    F.cross_entropy(reference(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_ddp_gradient_equals_full_batch_lenet(tmp_path):
    spawn_ranks(_grad_parity, 2, tmp_path, "lenet")


def test_ddp_gradient_equals_full_batch_resnet18(tmp_path):
    spawn_ranks(_grad_parity, 2, tmp_path, "resnet18")




def _train_and_dump(rank, world, out_dir):
    job = load_frozen(out_dir / "run")
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    trainer = Trainer(job, env, torch.device("cpu"), "gloo")
    trainer.fit()
    torch.save(trainer.model.state_dict(), out_dir / f"params-{rank}.pt")


def test_two_rank_training_reduces_loss_and_ranks_agree(tmp_path):
    run = tmp_path / "run"
    job, _ = plan("train.max_steps=40", "train.log_every_steps=5", "model=mlp", run_dir=run)
    freeze(job, run)
    spawn_ranks(_train_and_dump, 2, tmp_path)
    p0, p1 = (torch.load(tmp_path / f"params-{r}.pt") for r in (0, 1))
    for name in p0:
        assert torch.equal(p0[name], p1[name]), f"{name} differs between ranks"
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], losses
