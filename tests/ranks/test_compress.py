"""Compression of what crosses nodes (launcher/comm/compress.py) on real gloo ranks: bf16 against an fp32
reference, PowerSGD at full rank against the exact sum, error feedback checked by hand, and both engines (our
reducer under either overlap, torch DDP through our hook) with several buckets against torch DDP."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness.ranks import spawn_ranks, virtual_env
from launcher.comm import Topology, collectives, hierarchical_allreduce
from launcher.comm.collectives import AbortableHook, abortable_hook
from launcher.comm.compress import Bf16, Matrix, PowerSGD, build_compression
from launcher.comm.reducer import BucketedReducer
from launcher.group.abort import Abort


def _node_sums(per_rank: list[torch.Tensor], per_node: int) -> list[torch.Tensor]:
    return [sum(per_rank[i : i + per_node]) for i in range(0, len(per_rank), per_node)]


def _inputs(world: int, shape: tuple[int, ...], step: int = 0) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(world)]


def _bf16(rank, world, out_dir, per_node):
    env = virtual_env(rank, world, per_node)
    with Topology.build(env) as topo:
        bf16 = Bf16()
        bf16.begin_step()
        inputs = _inputs(world, (300_000,))  # two pipeline segments and a bit
        mine = inputs[rank].clone()
        hierarchical_allreduce(mine, topo, bf16).wait()
        exact = sum(inputs)
        # only the leaders' stage is rounded: each node's exact sum in bf16, summed
        rounded = sum(s.to(torch.bfloat16).float() for s in _node_sums(inputs, per_node))
        # (the node sums' fp32 order may differ from this one's: a value at a rounding boundary moves one bf16 step)
        torch.testing.assert_close(mine, rounded.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(mine, exact, rtol=2e-2, atol=2e-2)
        assert not torch.equal(mine, exact)  # it did round


@pytest.mark.parametrize("world, per_node", [(4, 2), (2, 1)], ids=["2x2", "2x1"])
def test_bf16_rounds_only_what_crosses_nodes(tmp_path, world, per_node):
    spawn_ranks(_bf16, world, tmp_path, per_node)


def _powersgd(rank, world, out_dir, per_node, in_order):
    env = virtual_env(rank, world, per_node)
    with Topology.build(env) as topo:
        topo.launch_in_order = in_order  # NCCL's path (one thread issues everything), here on gloo
        # full rank: the sum is exact (to float error), vectors and matrices alike; the vector rides in P's
        # buffer, or (a segment smaller than the vector) travels in segments of its own
        full = PowerSGD(rank=48, min_gain=0)
        for segment_bytes in (collectives.SEGMENT_BYTES, 128):
            collectives.SEGMENT_BYTES = segment_bytes
            full.begin_step()
            weight, bias = _inputs(world, (64, 48)), _inputs(world, (64,), 1)
            bucket = torch.cat([weight[rank].view(-1), bias[rank]])
            matrices = [Matrix(bucket[: 64 * 48].view(64, 48), 0), Matrix(bucket[64 * 48 :], 1)]
            hierarchical_allreduce(bucket, topo, full, matrices).wait()
            torch.testing.assert_close(bucket[: 64 * 48].view(64, 48), sum(weight), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(bucket[64 * 48 :], sum(bias), rtol=0, atol=1e-5)
        collectives.SEGMENT_BYTES = 4 * 2**20
        # every rank keeps an error for the matrix (factor first: its own share), none for the vector
        assert 0 in full.errors and 1 not in full.errors, list(full.errors)
        # rank 1: the error feedback is what each rank did not send, by hand
        low = PowerSGD(rank=1, min_gain=0)
        sums = []
        for step in range(3):
            low.begin_step()
            inputs = _inputs(world, (32, 16), step + 2)
            mine = inputs[rank].clone()
            before = low.errors.get(7, torch.zeros(32, 16)).clone()
            errors = _everyones(before, world)
            q = low.qs.get(7)
            hierarchical_allreduce(mine, topo, low, [Matrix(mine, 7)]).wait()
            if q is None:
                q = torch.randn(1, 16, generator=torch.Generator().manual_seed(7))  # kept transposed
            ms = [x + e for x, e in zip(inputs, errors)]  # each rank's gradient plus its own error
            p = torch.linalg.qr(sum(ms) @ q.t()).Q
            torch.testing.assert_close(low.errors[7], ms[rank] - p @ (ms[rank].t() @ p).t(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine, p @ (sum(ms).t() @ p).t(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(low.qs[7], (sum(ms).t() @ p).t(), rtol=1e-4, atol=1e-4)  # the warm start
            sums.append(mine)
        # every rank holds the same approximation
        for s in sums:
            gathered = [torch.empty_like(s) for _ in range(world)]
            dist.all_gather(gathered, s)
            assert all(torch.equal(g, s) for g in gathered)


def _everyones(mine: torch.Tensor, world: int) -> list:
    """Every rank's error before this step, gathered (each holds only its own). Collective."""
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine.contiguous())
    return gathered


@pytest.mark.parametrize(
    "world, per_node, in_order", [(4, 2, False), (2, 1, False), (4, 2, True)], ids=["2x2", "2x1", "2x2-in-order"]
)
def test_powersgd_full_rank_is_exact_and_its_error_is_what_was_not_sent(tmp_path, world, per_node, in_order):
    spawn_ranks(_powersgd, world, tmp_path, per_node, in_order)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _engines(rank, world, out_dir, per_node):
    """Full-rank PowerSGD (and bf16 to its tolerance) trains what torch DDP trains: several buckets, both
    overlaps of ours, and torch DDP through our hook."""
    env = virtual_env(rank, world, per_node)
    with Topology.build(env) as topo:
        steps = 6

        def batch(step):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            return torch.randn(8, 12, generator=gen), torch.randint(0, 6, (8,), generator=gen)

        ref = _Net()
        ddp = DistributedDataParallel(ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(steps):
            x, y = batch(step)
            nn.functional.cross_entropy(ddp(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for mode, overlap in [("powersgd", "backward"), ("powersgd", "forward"), ("bf16", "forward"), ("hook", "")]:
            model = _Net()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            compression = (
                build_compression("bf16", warmup_steps=2)
                if mode == "bf16"
                else PowerSGD(rank=40, warmup_steps=2, min_gain=0)
            )
            if mode == "hook":
                wrapped = DistributedDataParallel(model, bucket_cap_mb=0.002)
                keys = {id(p): i for i, p in enumerate(model.parameters())}
                wrapped.register_comm_hook(AbortableHook(topo, True, Abort(), compression, keys), abortable_hook)
                step_fn = opt.step
            else:
                reducer = BucketedReducer(
                    model,
                    topo,
                    bucket_cap_mb=0.002,
                    first_bucket_mb=0.001,
                    optimizer=opt,
                    overlap=overlap,
                    compression=compression,
                )
                assert len(reducer.buckets) >= 3, reducer.describe()
                wrapped, step_fn = model, reducer.step
            for step in range(steps):
                x, y = batch(step)
                nn.functional.cross_entropy(wrapped(x), y).backward()
                step_fn()
                opt.zero_grad()
            if mode != "hook":
                reducer.flush()
                reducer.close()
            tol = 2e-2 if mode == "bf16" else 1e-4
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=f"{mode} {overlap}: {name}")
            kept = 0 if mode == "bf16" else 3  # every rank keeps its own error per matrix
            assert compression.steps == steps and len(getattr(compression, "errors", {})) == kept


def test_both_engines_with_compression_train_as_ddp_does(tmp_path):
    spawn_ranks(_engines, 4, tmp_path, 2)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"compress='zip' is not one of none, bf16, powersgd"):
        build_compression("zip")
    with pytest.raises(ValueError, match=r"rank=0 must be >= 1"):
        PowerSGD(rank=0)


def _healed(rank, world, out_dir, per_node):
    """After a heal the sync is built again: the compression state starts anew on every rank alike (a joiner has
    none to carry), said once by rank 0; a resume on the same layout takes each rank's own."""
    import logging

    from launcher.config.schema import CommConfig
    from launcher.train.sync import build_sync

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("launcher.comm.sync").addHandler(handler)
    logging.getLogger("launcher.comm.sync").setLevel(logging.INFO)
    env = virtual_env(rank, world, per_node)
    cfg = CommConfig(reducer="ddp", hierarchical="true", compress="powersgd", compress_warmup_steps=2)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = [{"layout": [[0, 1], [2, 3]], "mode": "powersgd", "rank": 4, "steps": 7, "fingerprint": []}] * world
    resumed = build_sync(model, env, torch.device("cpu"), cfg, opt, resumed_compression=saved)
    assert resumed.compression.steps == 7 and not said, said  # the same layout: taken over, nothing said
    resumed.close()
    healed = build_sync(model, env, torch.device("cpu"), cfg, opt, resumed_compression=saved, healed=True)
    assert healed.compression.steps == 0, healed.compression.steps
    expected = "compression: error feedback and Qs start anew (healed in place: the ranks changed; 2 step(s)"
    assert (len(said) == 1 and said[0].startswith(expected)) if rank == 0 else not said, said
    healed.close()


def test_a_heal_starts_the_compression_state_anew_on_every_rank(tmp_path):
    spawn_ranks(_healed, 4, tmp_path, 2)
