"""Topology and node-first allreduce on real gloo ranks, with virtual nodes (DistEnv says who shares a node)."""

import time

import pytest
import torch

from harness.ranks import spawn_ranks, virtual_env
from launcher.base.env import DistEnv
from launcher.comm import Layout, Topology, flat_allreduce, hierarchical_allreduce


def _hier_equals_flat(rank, world, out_dir, per_node, interleaved, in_order=False):
    env = virtual_env(rank, world, per_node, interleaved)
    with Topology.build(env) as topo:
        assert not topo.launch_in_order  # gloo: the pipeline's threads
        topo.launch_in_order = in_order  # NCCL's path: one thread, one launch order (here on gloo)
        _check_hier_equals_flat(topo, env, rank, world, per_node)


def _check_hier_equals_flat(topo, env, rank, world, per_node):
    assert len(topo.node_ranks) == per_node and env.rank in topo.node_ranks
    for numel in (1, 7, 1000, 262_145):  # odd sizes, and a 1 MB tensor
        gen = torch.Generator().manual_seed(numel * 100 + rank)
        x = torch.randn(numel, generator=gen)
        flat, hier = x.clone(), x.clone()
        assert flat_allreduce(flat).wait() is flat
        assert hierarchical_allreduce(hier, topo).wait() is hier
        torch.testing.assert_close(hier, flat, rtol=1e-5, atol=1e-5)
    # several in flight at once, completed out of order of waiting: every group keeps bucket order
    xs = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(6)]
    futures = [hierarchical_allreduce(x, topo) for x in xs]
    for i, f in reversed(list(enumerate(futures))):
        expect = sum(r + i for r in range(world))
        assert torch.all(f.wait() == expect), (i, f.wait()[:3])


@pytest.mark.parametrize(
    "world, per_node, interleaved",
    [(2, 1, False), (2, 2, False), (4, 2, False), (4, 2, True)],
    ids=["2x1", "1x2", "2x2", "2x2-interleaved"],
)
def test_hierarchical_equals_flat(tmp_path, world, per_node, interleaved):
    spawn_ranks(_hier_equals_flat, world, tmp_path, per_node, interleaved)


@pytest.mark.parametrize("interleaved", [False, True], ids=["2x2", "2x2-interleaved"])
def test_hierarchical_in_launch_order_equals_flat(tmp_path, interleaved):
    """The path NCCL takes (every phase issued by the caller, in one order), checked on gloo."""
    spawn_ranks(_hier_equals_flat, 4, tmp_path, 2, interleaved, True)


def test_layout_from_pairs():
    layout = Layout.from_pairs([(0, 0), (1, 0), (0, 1), (1, 1)])
    assert layout.nodes == ((0, 2), (1, 3)) and layout.leaders == (0, 1) and layout.interleaved()
    assert layout.inter_groups() == [(0, 1), (2, 3)]
    uneven = Layout.from_pairs([(0, 0), (0, 1), (0, 2), (1, 0)])
    assert uneven.nodes == ((0, 1, 2), (3,)) and uneven.inter_groups() == [(0, 3), (1,), (2,)]


def test_layout_rejects_inconsistent_local_ranks():
    with pytest.raises(ValueError, match="ranks 0 and 1 both claim local rank 0 on node 0"):
        Layout.from_pairs([(0, 0), (0, 0)])
    with pytest.raises(ValueError, match=r"node 1 has local ranks \[1\]; expected 0..0"):
        Layout.from_pairs([(0, 0), (1, 1)])


def _uneven(rank, world, out_dir):
    # node 0 holds ranks 0, 1, 2; node 1 holds rank 3
    node, local = (0, rank) if rank < 3 else (1, 0)
    env = DistEnv(
        rank=rank, local_rank=local, world_size=4, local_world_size=3 if node == 0 else 1, node_rank=node, num_nodes=2
    )
    with Topology.build(env) as topo:
        x = torch.arange(10, dtype=torch.float32) * (rank + 1)
        hierarchical_allreduce(x, topo).wait()
    torch.testing.assert_close(x, torch.arange(10, dtype=torch.float32) * 10)


def test_uneven_layout(tmp_path):
    spawn_ranks(_uneven, 4, tmp_path)


def _stuck_in_a_node_group(rank, world, out_dir, timeout_s):
    env = virtual_env(rank, world, per_node=2)
    with Topology.build(env, timeout_s=timeout_s) as topo:
        if rank == 1:  # rank 0 (same node) never joins this allreduce: rank 1 must fail after timeout_s
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="[Tt]imed out"):
                torch.distributed.all_reduce(torch.ones(4), group=topo.intra)
            (out_dir / "waited.txt").write_text(str(time.monotonic() - started))
        torch.distributed.barrier()  # rank 0 stays in the group meanwhile (no "closed by peer" shortcut)


def test_node_groups_time_out_with_the_jobs_timeout(tmp_path):
    """torch gives new groups its own 30 min default; node-first steps must fail after comm.timeout_s as flat
    ones do (a rank stuck in the intra-node step would otherwise hang its node for half an hour)."""
    spawn_ranks(_stuck_in_a_node_group, 4, tmp_path, 3.0, timeout=60)
    waited = float((tmp_path / "waited.txt").read_text())
    assert 2.5 <= waited < 15, waited
