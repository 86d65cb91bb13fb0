"""Checkpoints: atomic writes, pruning, map_location, and weights saved through wrappers (``module.``)."""

import pytest
import torch
from torch import nn

from launcher.train import checkpoint as ckpt
from models import LeNet


def test_module_prefix_from_dataparallel_loads_into_plain_model(tmp_path):
    torch.manual_seed(0)
    wrapped = nn.DataParallel(LeNet())  # saves keys as "module.features.0.weight", as the seeds describe
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
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


def test_list_and_prune(tmp_path):
    for step in (5, 100, 20, 7):
        ckpt.save_atomic({"step": step}, ckpt.checkpoint_path(tmp_path, step))
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000005.pt", "step-00000007.pt", "step-00000020.pt", "step-00000100.pt"]
    ckpt.prune(tmp_path, keep=2)
    assert [ckpt.load(p)["step"] for p in ckpt.list_checkpoints(tmp_path)] == [20, 100]
    assert ckpt.list_checkpoints(tmp_path / "missing") == []
