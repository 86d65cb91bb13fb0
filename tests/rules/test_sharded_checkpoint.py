"""A sharded job's checkpoint directory (``launcher.train.sharded``), in one process (DCP runs without a process
group): what it holds, that it loads back, that it appears whole or not at all (a write that fails, a full disk, is
named with its rank and leaves the previous checkpoint the newest), that a plain model loads it, that a job of the
other kind (replicated) takes it, as another layout, and that a model not the checkpoint's is refused, naming what
differs (the resumes on other layouts: tests/jobs/test_reshard.py). The sharded job itself, every rank its own shard:
tests/jobs/test_fsdp_checkpoints.py."""

import errno
import io
import re
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
from launcher.group.helpers import Peers
from launcher.train import checkpoint as ckpt
from launcher.train import reshard, sharded
from launcher.train.saving import layout_change, resumable

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
    sharded.load_shards(path, fresh, fresh_optimizer)
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


def test_a_checkpoint_of_the_other_kind_resumes_and_says_how_it_differs(tmp_path):
    """A replicated job's file into a sharded job, a sharded job's directory into a replicated one: resumed (each
    rank loads its part as this job holds it: tests/jobs/test_reshard.py), named as another layout; the same kind
    and comm.shard is none."""
    write(tmp_path, 10, *trained(0))
    directory, file = sharded_path(tmp_path, 10), checkpoint_path(tmp_path, 10)
    ckpt.save_atomic({"step": 10, "config": {"comm": {"reducer": "ddp"}}}, file)
    node = {"step": 10, "world_size": 1, "config": {"comm": {"reducer": "fsdp", "shard": "node"}}}
    cpu = torch.device("cpu")
    assert resumable(file, ckpt.read(file), DistEnv(), cpu) == ckpt.read(file)
    assert resumable(directory, ckpt.read(directory), DistEnv(), cpu)["log_window"] == [{"from_step": 10}]
    jobs = {r: plan(f"comm.reducer={r}", run_dir=tmp_path / "run")[0] for r in ("ddp", "fsdp")}
    assert layout_change(directory, node, jobs["ddp"]) == "comm.reducer=fsdp wrote it, this job is comm.reducer=ddp"
    said = "comm.reducer=ddp wrote it, this job is comm.reducer=fsdp"
    assert layout_change(file, ckpt.read(file), jobs["fsdp"]) == said
    assert layout_change(directory, node, jobs["fsdp"]) is None and layout_change(file, {}, jobs["ddp"]) is None
    world = plan("comm.reducer=fsdp", "comm.shard=world", run_dir=tmp_path / "run")[0]
    said = "comm.shard=node wrote it, this job shards with comm.shard=world"
    assert layout_change(directory, node, world) == said


def test_a_model_that_is_not_the_checkpoints_is_refused_naming_what_differs(tmp_path):
    """Before anything loads (DCP would fail in its internals on a missing name, and load a model with fewer tensors
    partly): the names only in one of them, the shapes that differ, the fix."""
    model, optimizer = trained(0)
    write(tmp_path, 10, model, optimizer)
    expected = (
        r"cannot resume checkpoint {}: its model is not this job's \(only in this job's model: 3.bias, 3.weight; "
        r"of another shape: 0.bias \[4\] saved, \[5\] here, 0.weight \[4, 6\] saved, \[5, 6\] here, "
        r"2.weight \[3, 4\] saved, \[3, 5\] here\); HINT: resume it with the model settings of the run that wrote "
        r"it \(its config.yaml\), or start over with train.resume=never or a new hydra.run.dir"
    )
    wider = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 3))  # a layer more, wider
    for path, saved in (
        (sharded_path(tmp_path, 10), reshard.dcp_shapes(sharded_path(tmp_path, 10))),
        (checkpoint_path(tmp_path, 10), reshard.file_shapes({f"module.{k}": v for k, v in model.state_dict().items()})),
    ):
        with pytest.raises(ValueError, match=expected.format(re.escape(str(path)))):
            reshard.check_model(path, wider, saved)
    narrower = nn.Sequential(nn.Linear(6, 4))  # (DCP would load its one layer and leave the rest unsaid)
    with pytest.raises(ValueError, match=r"\(only in the checkpoint: 2.bias, 2.weight\); HINT: "):
        reshard.check_model(sharded_path(tmp_path, 10), narrower, reshard.dcp_shapes(sharded_path(tmp_path, 10)))
    reshard.check_model(sharded_path(tmp_path, 10), trained(1)[0], reshard.dcp_shapes(sharded_path(tmp_path, 10)))
