"""A sharded job's checkpoint directory (``launcher.train.sharded``), in one process (DCP runs without a process
group): what it holds, that it loads back, that it appears whole or not at all (a write that fails, a full disk, is
named with its rank and leaves the previous checkpoint the newest), that a plain model loads it, and that a job of
the other kind (replicated) refuses it with the fix. The sharded job itself, every rank its own shard:
tests/jobs/test_fsdp_checkpoints.py."""

import errno
import io
from contextlib import contextmanager

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_files
from torch import nn

from harness.config import plan
from launcher.base.checkpoint_names import (
    DCP_METADATA,
    TRAIN_STATE,
    checkpoint_path,
    list_checkpoints,
    rank_state,
    sharded_path,
)
from launcher.base.env import DistEnv
from launcher.dist.helpers import Peers
from launcher.train import checkpoint as ckpt
from launcher.train import sharded
from launcher.train.saving import resumable

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and its SGD with momentum, one step in (the optimiser has state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 6)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def write(directory, step, model, optimizer):
    own = {"rng": torch.get_rng_state(), "log_window": {"from_step": step}, "compression": None}
    sharded.save(sharded_path(directory, step), model, optimizer, Peers(), 0, own, {"step": step, "world_size": 1})


def test_a_checkpoint_directory_holds_the_shards_and_loads_back(tmp_path):
    model, optimizer = trained(0)
    write(tmp_path, 10, model, optimizer)
    path = sharded_path(tmp_path, 10)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [DCP_METADATA, "__0_0.distcp", TRAIN_STATE, "train.pt.sha256", "own-0.pt", "own-0.pt.sha256"]
    )
    assert list_checkpoints(tmp_path) == [path]
    assert ckpt.read(path) == {"step": 10, "world_size": 1, "format_version": 1}  # train.pt: no model, no optimiser
    named = ckpt.resume_source(str(path), tmp_path / "elsewhere", torch.device("cpu"))  # train.resume=DIR
    assert named == (path, ckpt.read(path)) == ckpt.resume_source("auto", tmp_path, torch.device("cpu"))
    fresh, fresh_optimizer = trained(1)
    sharded.load(path, fresh, fresh_optimizer)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["momentum_buffer"], fresh_optimizer.state[b]["momentum_buffer"])
    plain, _ = trained(2)  # a plain model, whole, from the shards (one process, no process group)
    ckpt.load_model_state(plain, path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    view = sharded.own_view(path, ckpt.read(path), 0, 1, torch.device("cpu"))
    assert view["log_window"] == [{"from_step": 10}] and "compression" not in view  # (this rank's, at its place)
    assert sharded.own_view(path, ckpt.read(path), 0, 2, torch.device("cpu")).keys() == ckpt.read(path).keys()


def test_a_step_written_again_replaces_the_old_directory_whole(tmp_path):
    write(tmp_path, 10, *trained(0))
    model, optimizer = trained(1)
    write(tmp_path, 10, model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010"]  # no .tmp, no .old left
    plain, _ = trained(2)
    ckpt.load_model_state(plain, sharded_path(tmp_path, 10))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


class FullDisk(io.RawIOBase):
    """A file on a full disk: every write fails as the system fails it."""

    def writable(self):
        return True

    def tell(self):
        return 0

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_names_the_rank_and_leaves_the_previous_checkpoint_newest(tmp_path, monkeypatch):
    """DCP writes each tensor with torch.save, which says only "unexpected pos" when the disk is full: the error is
    the system's, with the rank; the half-written directory goes, the previous checkpoint stays the newest."""
    write(tmp_path, 10, *trained(0))

    @contextmanager
    def full(self, path, mode):
        yield FullDisk()

    monkeypatch.setattr(dcp_files.FileSystem, "create_stream", full)
    with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device \(rank 0\)$"):
        write(tmp_path, 20, *trained(1))
    assert list_checkpoints(tmp_path) == [sharded_path(tmp_path, 10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010"]  # the half-written one removed
    monkeypatch.undo()

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_atomic", no_space)  # this rank's own file: the same, before DCP writes anything
    with pytest.raises(OSError, match=r"No space left on device \(rank 0\)"):
        write(tmp_path, 20, *trained(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000010"]
    ckpt.verify(rank_state(sharded_path(tmp_path, 10), 0))


@pytest.mark.parametrize("reducer", ["fsdp", "ddp"])
def test_a_checkpoint_of_the_other_kind_is_refused_with_the_fix(tmp_path, reducer):
    """A replicated job's file into a sharded job, a sharded job's directory into a replicated one: refused (loading
    one layout into the other is resharding), naming both and what resumes it."""
    job, _ = plan(f"comm.reducer={reducer}", run_dir=tmp_path / "run")
    path = checkpoint_path(tmp_path, 10)
    if reducer == "fsdp":
        ckpt.save_atomic({"step": 10}, path)
    else:
        write(tmp_path, 10, *trained(0))
        path = sharded_path(tmp_path, 10)
    wrote = "a replicated job (ddp, bucketed): one file" if reducer == "fsdp" else "comm.reducer=fsdp: a directory"
    again = "comm.reducer=ddp or comm.reducer=bucketed" if reducer == "fsdp" else "comm.reducer=fsdp"
    with pytest.raises(ValueError) as refused:
        resumable(path, ckpt.read(path), job, DistEnv(), torch.device("cpu"))
    assert str(refused.value).startswith(
        f"cannot resume checkpoint {path}, written by {wrote}"
    ) and f"in this comm.reducer={reducer} job; HINT: run with {again} to resume it" in str(refused.value)
