"""BucketedReducer on real gloo ranks: gradients equal torch DDP's and a single process's on the full batch."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from harness.ranks import spawn_ranks, virtual_env
from launcher.comm import Topology, hierarchical_hook
from launcher.comm.buckets import plan_buckets
from launcher.comm.policy import LinkFit, bucket_cap_mb, measure_link
from launcher.comm.reducer import BucketedReducer
from launcher.comm.sizes import MB, mb


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))


def batch(n=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def full_batch_grads(x, y):
    reference = make_model()
    F.cross_entropy(reference(x), y).backward()
    return [p.grad for p in reference.parameters()]


# bucket caps: one bucket per parameter (tiny cap), mixed, one bucket for all (huge cap)
CAPS = [(1e-6, 1e-6), (0.02, 0.04), (100.0, 100.0)]


def _parity(rank, world, out_dir, per_node, hierarchical):
    env = virtual_env(rank, world, per_node)
    x, y = batch()
    expected = full_batch_grads(x, y)
    with Topology.build(env) as topo:
        for first_mb, cap_mb in CAPS:
            model = make_model()
            reducer = BucketedReducer(
                model, topo, bucket_cap_mb=cap_mb, first_bucket_mb=first_mb, hierarchical=hierarchical
            )
            for _step in range(2):  # the second step checks that state resets between backward passes
                reducer.zero_grad()
                F.cross_entropy(model(shard(x, rank, world)), shard(y, rank, world)).backward()
                for p, q in zip(model.parameters(), expected):
                    torch.testing.assert_close(p.grad, q, rtol=1e-5, atol=1e-6)
            if cap_mb < 1e-3:
                assert len(reducer.buckets) == len(list(model.parameters()))
            if cap_mb > 1:
                assert len(reducer.buckets) == 1
        # torch DDP, with and without our node-first comm hook, agrees too
        for hook in (None, hierarchical_hook):
            model = make_model()
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)
            if hook is not None:
                ddp.register_comm_hook(topo, hook)
            F.cross_entropy(ddp(shard(x, rank, world)), shard(y, rank, world)).backward()
            for p, q in zip(model.parameters(), expected):
                torch.testing.assert_close(p.grad, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "world, per_node, hierarchical",
    [(2, 2, False), (2, 1, True), (4, 2, False), (4, 2, True)],
    ids=["1x2-flat", "2x1-hier", "2x2-flat", "2x2-hier"],
)
def test_gradients_equal_full_batch_and_ddp(tmp_path, world, per_node, hierarchical):
    spawn_ranks(_parity, world, tmp_path, per_node, hierarchical)


def _no_sync(rank, world, out_dir):
    env = virtual_env(rank, world, 1)
    x, y = batch(32)
    expected = full_batch_grads(x, y)
    with Topology.build(env) as topo:
        model = make_model()
        reducer = BucketedReducer(model, topo, bucket_cap_mb=0.02)
        mine_x, mine_y = shard(x, rank, world), shard(y, rank, world)
        micro = 4
        reducer.zero_grad()
        for i in range(micro):
            ctx = reducer.no_sync() if i < micro - 1 else torch.enable_grad()
            with ctx:
                part = slice(i * 4, (i + 1) * 4)
                (F.cross_entropy(model(mine_x[part]), mine_y[part]) / micro).backward()
            # nothing launched inside no_sync; every bucket once after the last micro-batch
            assert reducer.launched == (0 if i < micro - 1 else len(reducer.buckets))
        for p, q in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, q, rtol=1e-5, atol=1e-6)


def test_no_sync_accumulation_equals_large_batch(tmp_path):
    spawn_ranks(_no_sync, 2, tmp_path)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused_head = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _unused(rank, world, out_dir, find_unused):
    env = virtual_env(rank, world, 1)
    with Topology.build(env) as topo:
        model = Branchy()
        _reducer = BucketedReducer(model, topo, find_unused_parameters=find_unused)  # its hooks do the work
        loss = model(torch.randn(3, 4)).sum()
        if find_unused:
            loss.backward()
            assert model.unused_head.weight.grad is None  # no rank used it: .grad untouched, as under DDP
        else:
            with pytest.raises(
                RuntimeError,
                match=r"parameters got no gradient in this backward pass: "
                r"unused_head.bias, unused_head.weight",
            ):
                loss.backward()


@pytest.mark.parametrize("find_unused", [False, True])
def test_unused_parameters(tmp_path, find_unused):
    spawn_ranks(_unused, 2, tmp_path, find_unused)


def _grads_are_views(rank, world, out_dir):
    with Topology.build(virtual_env(rank, world, 1)) as topo:
        model = make_model()
        reducer = BucketedReducer(model, topo, bucket_cap_mb=0.02)
        assert all(p.grad is None for p in model.parameters())  # as under DDP, until the first backward
        x, y = batch()
        F.cross_entropy(model(x), y).backward()
        ptrs = [p.grad.data_ptr() for p in model.parameters()]
        assert sorted(ptrs) == sorted(v.data_ptr() for b in reducer.buckets for v in b.views)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            reducer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs  # no new gradient tensors
        opt.zero_grad(set_to_none=True)  # what a plain optimizer loop does: the reducer re-binds the views
        F.cross_entropy(model(x), y).backward()
        assert [p.grad.data_ptr() for p in model.parameters()] == ptrs


def test_gradients_live_in_bucket_buffers(tmp_path):
    spawn_ranks(_grads_are_views, 2, tmp_path)


def test_plan_buckets():
    f32 = "f32"
    # reverse-order sizes in bytes: a bucket closes once it holds its cap (1 MB first, then 4 MB); no splits
    sizes = [0.5 * MB, 0.5 * MB, 0.5 * MB, 3 * MB, 2 * MB, 5 * MB, 1 * MB]
    assert plan_buckets(sizes, [f32] * 7, 1 * MB, 4 * MB) == [[0, 1], [2, 3, 4], [5], [6]]
    # bias then weight of each layer (a 6 x Linear(1024, 1024) MLP, reversed): one bucket per layer at 1 MB
    layer = [4 * 1024, 4 * MB]
    assert plan_buckets(layer * 6, [f32] * 12, 1 * MB, 1 * MB) == [[2 * i, 2 * i + 1] for i in range(6)]
    assert plan_buckets(sizes, [f32] * 7, 100 * MB, 100 * MB) == [[0, 1, 2, 3, 4, 5, 6]]
    assert plan_buckets([1, 1, 1], ["a", "b", "b"], 100, 100) == [[0], [1, 2]]


def test_bucket_cap_policy():
    # a fast link with little latency: the 1 MB floor; a slow-latency link: latency-bound; small models: capped
    fast = LinkFit(alpha_s=50e-6, beta_bps=1e9)  # 50 us, 1 GB/s: 10 x alpha x beta = 0.45 MB
    assert bucket_cap_mb(fast, 100 * MB) == 1.0
    slow = LinkFit(alpha_s=2e-3, beta_bps=1e9)  # 2 ms: 2 ms x 1 GB/s x 9 = 17.2 MB
    assert bucket_cap_mb(slow, 400 * MB) == pytest.approx(2e-3 * 1e9 * 9 / MB)
    assert bucket_cap_mb(slow, 40 * MB) == 10.0  # at least 4 buckets for a 40 MB model
    assert bucket_cap_mb(LinkFit(1.0, 1e9), 4000 * MB) == 25.0  # never above torch DDP's default
    assert bucket_cap_mb(fast, 0.5 * MB) == 1.0  # a small model: one bucket


def wide_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def _policy_layouts(rank, world, out_dir):
    """Every rank measures the link and sizes buckets itself: the figures are agreed (max-reduced), so the
    layouts are identical; and training results do not depend on the layout beyond float tolerance."""
    from launcher.group import helpers as rank_helpers

    env = virtual_env(rank, world, 1)
    x, y = batch(32)
    with Topology.build(env) as topo:
        link = measure_link(topo, False, torch.device("cpu"), reps=3)
        model_bytes = sum(p.numel() * 4 for p in wide_model().parameters())  # 6.5 MB: the policy splits it
        caps = {"policy": bucket_cap_mb(link, model_bytes), "one bucket": 100.0, "per parameter": 1e-6}
        finals = {}
        for name, cap in caps.items():
            model = wide_model()
            reducer = BucketedReducer(model, topo, bucket_cap_mb=cap, first_bucket_mb=min(1.0, cap))
            layouts = rank_helpers.all_gather_object((cap, [(len(b.params), mb(b.buffer)) for b in reducer.buckets]))
            assert all(layout == layouts[0] for layout in layouts), layouts
            if name == "policy":  # several buckets, so "policy" is not the one-bucket layout under another name
                assert len(reducer.buckets) >= 3, reducer.describe()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for _step in range(5):
                reducer.zero_grad()
                F.cross_entropy(model(shard(x, rank, world)), shard(y, rank, world)).backward()
                opt.step()
            reducer.close()
            finals[name] = [p.detach().clone() for p in model.parameters()]
        for name in ("one bucket", "per parameter"):
            for a, b in zip(finals["policy"], finals[name]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_policy_gives_identical_layouts_and_layout_independent_results(tmp_path):
    spawn_ranks(_policy_layouts, 2, tmp_path)
