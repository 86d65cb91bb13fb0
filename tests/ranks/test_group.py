"""Process group and rank helpers on real gloo ranks; the d2l notes' allreduce example; hand-written data parallel."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from harness.ranks import spawn_ranks
from launcher import try_all_gpus, try_gpu
from launcher.base.env import DistEnv
from launcher.group import helpers as rank_helpers
from launcher.group.rendezvous import process_group
from models import LeNet
from models.dataparallel import HandDataParallel, allreduce_devices, split_batch

SECRET = "ab" * 32  # the job's secret, as every rank of one job has it


def _seeds_allreduce(rank, world, out_dir, healing=False):
    # The d2l notes' example: device i holds ones((1, 2)) * (i + 1); after allreduce every one holds [[3, 3]].
    # ``healing``: the same through the abortable, signed collectives of a job that heals in place
    from launcher.group.abort import Abort
    from launcher.trust.secret import Secret

    peers = rank_helpers.Peers(Abort(), Secret.from_hex(SECRET)) if healing else rank_helpers.Peers()
    data = torch.ones((1, 2)) * (rank + 1)
    peers.all_reduce(data)
    torch.testing.assert_close(data, torch.tensor([[3.0, 3.0]]), rtol=0, atol=0)
    mean = torch.ones(2) * (rank + 1)
    peers.all_reduce(mean, op="mean")
    torch.testing.assert_close(mean, torch.tensor([1.5, 1.5]))
    assert rank_helpers.get_rank() == rank and rank_helpers.get_world_size() == world
    assert peers.all_gather_object(f"r{rank}") == ["r0", "r1"]
    assert peers.gather_object("x" * (3 + rank), dst=1) == (["xxx", "xxxx"] if rank == 1 else None)
    assert peers.broadcast_object({"from": rank}) == {"from": 0}
    assert peers.broadcast_object(list(range(rank, 300)), src=1) == list(range(1, 300))
    module = torch.nn.BatchNorm1d(2)
    module.running_mean.fill_(rank)
    peers.broadcast_buffers(module)
    assert module.running_mean.tolist() == [0.0, 0.0]
    rank_helpers.barrier()


@pytest.mark.parametrize("healing", [False, True])
def test_seeds_allreduce_example_on_two_ranks(tmp_path, healing):
    spawn_ranks(_seeds_allreduce, 2, tmp_path, healing)


class Planted:
    """Unpickling it leaves a file: the proof that bytes were unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _forged_objects(rank, world, out_dir):
    from launcher.trust.secret import Secret
    from launcher.trust.signed import Forged

    mine = Secret.from_hex(SECRET if rank == 0 else "cd" * 32)  # rank 1 does not hold the job's secret
    planted = f"{out_dir}/planted-{rank}"
    for call in (
        lambda: rank_helpers.all_gather_object(Planted(planted), secret=mine),
        lambda: rank_helpers.broadcast_object(Planted(planted), src=1, secret=mine),
        lambda: rank_helpers.gather_object(Planted(planted), dst=0, secret=mine),
    ):
        if rank == 0:
            with pytest.raises(Forged, match="from rank 1 do not verify with the job's secret: not unpickled"):
                call()
        else:
            with contextlib.suppress(Forged):  # (rank 0's bytes do not verify with its key either)
                call()
    import os

    assert not os.path.exists(f"{out_dir}/planted-1"), "rank 0 unpickled rank 1's unverified bytes"


def test_object_collectives_refuse_bytes_without_the_jobs_secret_before_unpickling(tmp_path):
    spawn_ranks(_forged_objects, 2, tmp_path)


def test_helpers_without_process_group():
    assert not rank_helpers.is_initialized()
    t = torch.tensor([1.0, 2.0])
    assert rank_helpers.all_reduce(t) is t and t.tolist() == [1.0, 2.0]
    assert (rank_helpers.get_rank(), rank_helpers.get_world_size(), rank_helpers.is_main_process()) == (0, 1, True)
    assert rank_helpers.all_gather_object(7) == [7] and rank_helpers.broadcast_object(7) == 7
    assert rank_helpers.gather_object(7) == [7]
    rank_helpers.barrier()


def test_process_group_destroyed_even_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with process_group(DistEnv(), "gloo"):
            assert dist.is_initialized() and dist.get_world_size() == 1
            raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_try_gpu_falls_back_to_cpu():
    n = torch.cuda.device_count()
    assert try_gpu(n) == torch.device("cpu")
    assert try_all_gpus() == ([torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")])


def test_allreduce_devices_seeds_example():
    devices = [try_gpu(0), try_gpu(1)]
    data = [torch.ones((1, 2), device=d) * (i + 1) for i, d in enumerate(devices)]
    allreduce_devices(data)
    for t in data:
        assert t.tolist() == [[3.0, 3.0]]


def test_split_batch_rejects_uneven():
    with pytest.raises(ValueError, match="does not split evenly over 3 devices"):
        split_batch(torch.zeros(4, 1), torch.zeros(4), [torch.device("cpu")] * 3)


def test_hand_written_data_parallel_equals_full_batch_step():
    torch.manual_seed(0)
    model = LeNet()
    reference = LeNet()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    hand = HandDataParallel(model, [torch.device("cpu"), torch.device("cpu")])
    hand.train_batch(x, y, F.cross_entropy, lr=0.1)

    F.cross_entropy(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for replica in hand.replicas:
        for a, b in zip(replica.parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
