"""Checkpoints: atomic writes, pruning, map_location, and weights saved through wrappers (``module.``)."""

import os

import pytest
import torch
from torch import nn

from harness.modes import umask
from launcher.base.checkpoint_names import checkpoint_path, list_checkpoints
from launcher.train import checkpoint as ckpt
from models import LeNet


def test_module_prefix_from_dataparallel_loads_into_plain_model(tmp_path):
    torch.manual_seed(0)
    wrapped = nn.DataParallel(
        LeNet()
    )  # saves keys as "module.features.0.weight", as the d2l notes describe (nn.DataParallel checkpoints)
    path = tmp_path / "dp.pt"
    torch.save(wrapped.state_dict(), path)
    assert next(iter(torch.load(path))).startswith("module.")
    plain = LeNet()
    ckpt.load_model_state(plain, path)
    for a, b in zip(plain.state_dict().values(), wrapped.module.state_dict().values()):
        assert torch.equal(a, b)


def test_plain_checkpoint_loads_into_wrapped_model():
    source, target = LeNet(), nn.DataParallel(LeNet())
    ckpt.load_model_state(target, {"model": source.state_dict()})
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.module.parameters()))


def test_strip_prefixes_nested():
    state = {"module._orig_mod.fc.weight": 1, "_orig_mod.module.fc.bias": 2, "head.module.x": 3}
    assert ckpt.strip_prefixes(state) == {"fc.weight": 1, "fc.bias": 2, "head.module.x": 3}


def test_gpu_checkpoint_loads_on_cpu_with_map_location(tmp_path, monkeypatch):
    """Write a file whose tensors are tagged cuda:0 (as on a GPU box), then load it on this CPU box."""
    model = LeNet()
    path = tmp_path / "gpu.pt"
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"model": model.state_dict(), "step": 3}, path)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path, weights_only=True)  # what a user hits without map_location
    state = ckpt.load(path, map_location="cpu")
    assert state["step"] == 3 and state["model"]["classifier.1.weight"].device.type == "cpu"
    fresh = LeNet()
    ckpt.load_model_state(fresh, path, map_location="cpu")
    assert torch.equal(fresh.classifier[1].weight, model.classifier[1].weight)


def test_atomic_save_keeps_old_file_when_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "step-00000001.pt"
    ckpt.save_atomic({"x": torch.ones(2)}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space left"):
        ckpt.save_atomic({"x": torch.zeros(2)}, path)
    monkeypatch.undo()
    assert torch.equal(ckpt.load(path)["x"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + ".sha256"]  # no temp file left


def test_atomic_write_follows_no_link_planted_beside_the_target(tmp_path):
    """The temporary file is made by mkstemp: a link at any name a writer could predict (its pid) is not followed."""
    from launcher.base.files import write_atomic

    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "summary.json"
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (tmp_path / f".{target.name}.{pid}.tmp").symlink_to(victim)
    with umask(0o027):
        write_atomic(target, "{}")
    assert victim.read_text() == "untouched" and target.read_text() == "{}"
    assert oct(target.stat().st_mode & 0o777) == "0o640"  # the user's umask, no mode of its own (issue 51)


def test_list_and_prune(tmp_path):
    for step in (5, 100, 20, 7):
        ckpt.save_atomic({"step": step}, checkpoint_path(tmp_path, step))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000005.pt",
        "step-00000007.pt",
        "step-00000020.pt",
        "step-00000100.pt",
    ]
    ckpt.prune(tmp_path, keep=2)
    assert [ckpt.load(p)["step"] for p in list_checkpoints(tmp_path)] == [20, 100]
    assert list_checkpoints(tmp_path / "missing") == []


def test_truncated_newest_checkpoint_is_skipped(tmp_path):
    for step in (10, 20):
        ckpt.save_atomic({"step": step, "w": torch.randn(1000)}, checkpoint_path(tmp_path, step))
    newest = checkpoint_path(tmp_path, 20)
    newest.write_bytes(newest.read_bytes()[:100])  # a crash mid-copy, say
    path, state = ckpt.load_newest_valid(tmp_path)
    assert path == checkpoint_path(tmp_path, 10) and state["step"] == 10
    checkpoint_path(tmp_path, 20).with_name("step-00000020.pt.sha256").unlink()  # no digest: load check only
    assert ckpt.load_newest_valid(tmp_path)[1]["step"] == 10
    ckpt.save_atomic({"step": 20}, newest)
    newest.write_bytes(newest.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match=r"step-00000020.pt is corrupted \(sha256 differs"):
        ckpt.verify(newest)


def test_prune_removes_digests(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_atomic({"step": step}, checkpoint_path(tmp_path, step))
    ckpt.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003.pt", "step-00000003.pt.sha256"]


def test_prune_after_a_checkpoint_leaves_a_later_steps_write_under_way(tmp_path):
    """Rank 0 prunes once step 6 is whole; another rank, done with its part of step 6 sooner, may already write step
    8's directory in the background: only the leftovers of step 6 and before are removed (seen in a loaded full run:
    a rank's step-8 write lost its directory, ENOENT)."""
    for name in ("step-00000004.tmp", "step-00000006.old", "step-00000008.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-00000008.tmp" / "own-1.pt").write_bytes(b"being written")
    ckpt.prune(tmp_path, keep=2, step=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008.tmp"]
    ckpt.clear_leftovers(tmp_path)  # at the start: no write is under way, every leftover goes
    assert list(tmp_path.iterdir()) == []
