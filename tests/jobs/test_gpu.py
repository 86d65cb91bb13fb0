"""The CUDA path, on a real GPU only (``gpu`` mark; skipped where torch sees no CUDA device, never faked):
``./scripts/test.sh -m gpu``. The trainer through ``python -m launcher`` with nccl on one GPU, in each precision;
our reducer (flat, node-first, forward overlap) and torch DDP on CUDA tensors with two gloo ranks sharing the GPU,
against one process's full-batch step; a checkpoint written on the GPU loaded on the CPU; GPU choice by free
memory through NVML against what CUDA itself reports; sharded training (``comm.reducer=fsdp``) on one GPU."""

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from harness.ranks import spawn_ranks, virtual_env
from harness.run import run_launcher
from launcher.base import gpus
from launcher.comm import Topology
from launcher.comm.compress import Bf16, PowerSGD
from launcher.comm.reducer import BucketedReducer
from launcher.train import checkpoint as ckpt
from models import LeNet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU tests run where one is"),
]
JOB = ("train.max_steps=30", "train.log_every_steps=10", "train.checkpoint_every_steps=15", "model=lenet")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trainer_on_one_gpu_with_nccl(tmp_path, precision):
    done = run_launcher(*JOB, f"train.precision={precision}", run_dir=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["backend"], summary["device"], summary["steps"]) == ("nccl", "cuda", 30), summary
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").open() if '"train"' in line]
    assert losses[-1] < losses[0], losses
    # written on the GPU, read on a CPU-only machine: map_location, and the prefix-free state dict
    state = ckpt.load(sorted((tmp_path / "checkpoints").glob("*.pt"))[-1], map_location="cpu")
    model = LeNet()
    ckpt.load_model_state(model, state)
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sharded_trainer_on_one_gpu_with_nccl(tmp_path, precision):
    """``comm.reducer=fsdp`` on CUDA: FSDP2's streams under nccl, the mesh a cuda one (the plan line says so), the
    sharded checkpoint written and the loss falling. (The cross-node stage on CUDA needs two machines' GPUs.)"""
    done = run_launcher(*JOB, "comm.reducer=fsdp", f"train.precision={precision}", run_dir=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "FSDP2 on a 1-D cuda mesh of 1 rank(s)" in done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["backend"], summary["device"], summary["reducer"]) == ("nccl", "cuda", "fsdp"), summary
    assert (tmp_path / "checkpoints" / "step-00000030" / ".metadata").is_file()  # DCP's, every rank's shards in
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").open() if '"train"' in line]
    assert losses[-1] < losses[0], losses


def _reducers_on_cuda(rank, world, out_dir, mode, device_type="cuda"):
    device = torch.device(device_type, 0)  # both ranks share the GPU; gloo moves CUDA tensors through the host
    torch.manual_seed(0)
    model = LeNet().to(device)
    reference = LeNet().to(device)
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 1, 28, 28, generator=gen).to(device), torch.randint(0, 10, (16,), generator=gen).to(device)
    shard = slice(rank * 16 // world, (rank + 1) * 16 // world)
    env = virtual_env(rank, world, 1)  # one rank per virtual node: node-first is its leaders' stage only (gloo has
    #                                    no CUDA reduce; the intra-node stages on CUDA need nccl, i.e. two GPUs)
    topology = Topology.build(env)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "ddp":
        wrapped: nn.Module = DistributedDataParallel(model, bucket_cap_mb=0.05)
        F.cross_entropy(wrapped(x[shard]), y[shard]).backward()
        optimizer.step()
    else:
        reducer = BucketedReducer(
            model,
            topology,
            bucket_cap_mb=0.05,
            hierarchical=mode == "node-first",
            optimizer=optimizer,
            overlap="forward" if mode == "forward" else "backward",
            # compressed (issue 38): PowerSGD at full rank is exact; bf16 to its rounding
            compression={"powersgd": PowerSGD(rank=1000, min_gain=0), "bf16": Bf16()}.get(mode),
        )
        F.cross_entropy(model(x[shard]), y[shard]).backward()
        reducer.step()
        reducer.flush()
        reducer.close()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.cross_entropy(reference(x), y).backward()
    reference_optimizer.step()
    tol = 2e-2 if mode == "bf16" else 1e-4
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol / 10, msg=lambda m, n=name: f"{mode} {n}: {m}")
    topology.close()


@pytest.mark.parametrize("mode", ["ddp", "flat", "node-first", "forward", "powersgd", "bf16"])
def test_reducers_on_cuda_tensors_match_one_process(tmp_path, mode):
    spawn_ranks(_reducers_on_cuda, 2, tmp_path, mode)


def test_gpu_choice_by_free_memory_reads_nvml():
    free = gpus.free_memory_mib()
    assert set(free) == set(range(torch.cuda.device_count())), free
    for index, mib in free.items():  # what CUDA reports, within what other processes may take meanwhile
        cuda_free, _ = torch.cuda.mem_get_info(index)
        assert abs(mib - cuda_free // 2**20) < 2048, (index, mib, cuda_free // 2**20)
    chosen = gpus.by_free_memory(1, environ={})
    assert free[int(chosen)] == max(free.values()), (chosen, free)
