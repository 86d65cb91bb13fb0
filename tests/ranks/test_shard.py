"""The cross-node stage of sharded training (launcher/comm/shard.py) on real gloo ranks, 2 virtual nodes x 2: each
rank's shard of every weight reaches PowerSGD as the matrix it is (full rank: the exact sum; the error feedback kept
per shard, shaped as this rank's rows), and micro-batches under ``no_sync`` send nothing until the last."""

import pytest
import torch
from torch import nn

from harness.ranks import spawn_ranks, virtual_env
from launcher.base.sync_modes import Shard
from launcher.comm import Topology
from launcher.comm.compress import PowerSGD
from launcher.comm.shard import CrossNodeStage, ShardSpec, no_sync, shard_mesh, shard_model

WIDTHS = (12, 33, 20, 7)  # odd row counts: the last rank of a node holds fewer rows of some weights


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])]
    return nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2])


def _batch(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8 * world, WIDTHS[0], generator=torch.Generator().manual_seed(1))
    rows = slice(8 * rank, 8 * (rank + 1))
    return x, x[rows]


def _full_rank(rank, world, out_dir, micro):
    env = virtual_env(rank, world, 2)
    reference, model = _model(), _model()
    whole, mine = _batch(rank, world)
    reference(whole).square().mean().backward()
    shard_model(model, shard_mesh(env, Shard.node, "cpu"), ShardSpec(min_params=1, scatter_unused=True))
    with Topology.build(env) as topology:
        powersgd = PowerSGD(rank=64, warmup_steps=0, min_gain=0)  # full rank on every shard: exact
        stage = CrossNodeStage(model, topology, powersgd, None)
        for i, part in enumerate(mine.chunk(micro)):
            if i < micro - 1:
                with no_sync(model):
                    model(part).square().mean().div(micro).backward()
                assert not stage.futures and powersgd.steps == 0  # nothing sent before the last micro-batch
            else:
                model(part).square().mean().div(micro).backward()
        assert not stage.futures and stage.matrices_ok  # waited for; FSDP's grads were the views PowerSGD took
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: n + m)
        # one error and one Q per weight (the matrix keys: 0, 2, 4), each of this rank's rows of it
        local = {i: p.to_local().shape for i, p in enumerate(model.parameters()) if p.dim() == 2}
        assert {k: tuple(e.shape) for k, e in powersgd.errors.items()} == {k: tuple(s) for k, s in local.items()}
        stage.close()


@pytest.mark.parametrize("micro", [1, 4])
def test_powersgd_on_shards_at_full_rank_is_the_exact_gradient(tmp_path, micro):
    spawn_ranks(_full_rank, 4, tmp_path, micro)


def _rebuilt(rank, world, out_dir):
    """The cross-node stage's groups are the topology's, not the sharded model's: a new topology and stage (what a
    heal builds) take over the same sharded model, its hooks replaced, and the next backward is exact again."""
    env = virtual_env(rank, world, 2)
    reference, model = _model(), _model()
    whole, mine = _batch(rank, world)
    reference(whole).square().mean().backward()
    shard_model(model, shard_mesh(env, Shard.node, "cpu"), ShardSpec(min_params=1))
    for _ in range(2):
        with Topology.build(env) as topology:
            stage = CrossNodeStage(model, topology, PowerSGD(rank=64, warmup_steps=0, min_gain=0), None)
            for p in model.parameters():
                p.grad = None
            model(mine).square().mean().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(
                    p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: n + m
                )
            stage.close()


def test_a_new_cross_node_stage_takes_over_the_same_sharded_model(tmp_path):
    spawn_ranks(_rebuilt, 4, tmp_path)
