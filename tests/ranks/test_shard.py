"""The cross-node stage of sharded training (launcher/comm/shard.py) on real gloo ranks, 2 virtual nodes x 2: each
rank's shard of every weight reaches PowerSGD as the matrix it is (full rank: the exact sum; the error feedback kept
per shard, shaped as this rank's rows), and micro-batches under ``no_sync`` send nothing until the last; a Hugging
Face-style model warns of nothing that does not apply (issue 60); ``comm.shard=auto`` on one rank a machine shards
across the machines."""

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


def _text_classifier() -> nn.Module:
    from models.text_classifier import TextClassifier  # (the Hugging Face-style model of conf/model)

    torch.manual_seed(0)
    return TextClassifier(vocab_size=64, num_classes=2, max_len=16)


def _quiet(rank, world, out_dir, compress, layout):
    """2 virtual nodes x 2 ranks (HSDP), the Hugging Face-style model with the default units: what torch and the
    stage warn of, and whether PowerSGD's matrices are FSDP's gradient buffers as laid out (``layout="broken"``: a
    torch laying them out otherwise, as the stage would find it)."""
    import logging
    import warnings

    from launcher.comm import shard
    from launcher.comm.compress import Compression

    if layout == "broken":
        shard._Unit.layout_holds = lambda unit: False

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("launcher.comm.shard").addHandler(handler)
    env, model = virtual_env(rank, world, 2), _text_classifier()
    with warnings.catch_warnings(record=True) as caught, Topology.build(env) as topology:
        warnings.simplefilter("always")
        shard_model(model, shard_mesh(env, Shard.node, "cpu"), ShardSpec())
        compression = PowerSGD(rank=4, warmup_steps=0, min_gain=0) if compress == "powersgd" else Compression()
        stage = CrossNodeStage(model, topology, compression, None)
        ids = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            model(input_ids=ids, labels=ids[:, 0] % 2).loss.backward()
        said += [str(w.message) for w in caught]
        (out_dir / f"quiet-{rank}.txt").write_text(f"{stage.matrices_ok}\n" + "\n".join(said))
        stage.close()


LAYOUT_WARNING = "FSDP's gradient buffers are not laid out as expected: PowerSGD sends them uncompressed"


@pytest.mark.parametrize("compress, layout", [("none", "broken"), ("powersgd", "real"), ("powersgd", "broken")])
def test_hsdp_of_a_hugging_face_style_model_warns_of_nothing_that_does_not_apply(tmp_path, compress, layout):
    """Issue 60 (6.2, 6.3): uncompressed, every rank warned that PowerSGD sends FSDP's buffers uncompressed (there
    is no PowerSGD: nothing is checked now, even a layout that would not hold), and torch warned of units returning
    views; under PowerSGD the layout holds (it put an attention's own weight before its out_proj, which FSDP2 lays
    out after), and where it would not, the warning applies and is said."""
    spawn_ranks(_quiet, 4, tmp_path, compress, layout)
    applies = compress == "powersgd" and layout == "broken"
    for rank in range(4):
        matrices_ok, *said = (tmp_path / f"quiet-{rank}.txt").read_text().splitlines()
        assert said == ([LAYOUT_WARNING] if applies else []), f"rank {rank} warned: {said}"
        assert matrices_ok == str(not applies)


def _auto(rank, world, out_dir):
    """The trainer's sharding (``train/model.shard``) of a job frozen for 2 simulated machines x 1 rank."""
    from launcher.config import load_frozen
    from launcher.train.model import shard

    job, model = load_frozen(out_dir / "run"), _model()
    shard(job, virtual_env(rank, world, 1), torch.device("cpu"), model)
    sizes = {p.device_mesh.size() for p in model.parameters()}
    held = sum(p.to_local().numel() for p in model.parameters())
    (out_dir / f"auto-{rank}.txt").write_text(f"{job.comm.shard} {sorted(sizes)} {held}")


def test_a_sharded_job_on_two_machines_of_one_rank_shards_across_them_by_default(tmp_path):
    """Issue 60 (6.1): ``comm.shard=auto`` (the default) is ``world`` on one rank a node: each of the 2 ranks holds
    about half of the model (``node`` gave each the whole of it: 1/1)."""
    from harness.config import plan
    from launcher.config import freeze

    job, _ = plan("comm.reducer=fsdp", "+cluster=sim", "cluster.procs_per_node=1", run_dir=tmp_path / "run")
    freeze(job)
    spawn_ranks(_auto, 2, tmp_path)
    whole = sum(p.numel() for p in _model().parameters())
    for rank in range(2):
        shard, sizes, held = (tmp_path / f"auto-{rank}.txt").read_text().split(" ", 2)
        assert (shard, sizes) == ("world", "[2]")
        assert int(held) <= whole // 2 + 64, (held, whole)
