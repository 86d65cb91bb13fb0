"""``train.checkpoint_async=true``: a checkpoint staged at the step boundary and written on a background thread holds
what the synchronous save writes, for a replicated job (rank 0's file) and a sharded one (every rank's DCP shards,
on a gloo group of their own); the loop's record says what each save cost it."""

import json

import pytest
import torch
from hydra.utils import instantiate

from harness.run import run_launcher
from launcher.base.checkpoint_names import list_checkpoints, rank_state
from launcher.config import load_frozen
from launcher.train import checkpoint as ckpt

pytestmark = pytest.mark.slow
JOB = ("train.max_steps=12", "train.checkpoint_every_steps=4", "train.keep_checkpoints=5", "train.log_every_steps=4")


def same(a, b, where=""):
    """Equal values at every depth (tensors bit for bit), but the log window's own time (``elapsed_s``: a clock's)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for key in set(a) - {"elapsed_s"}:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def trained(tmp_path, name, *job):
    result = run_launcher(*JOB, *job, f"train.checkpoint_async={name == 'async'}", run_dir=tmp_path / name)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r["kind"] == "checkpoint"]
    assert [(r["step"], r["async"]) for r in saves] == [(s, name == "async") for s in (4, 8, 12)], saves
    return list_checkpoints(tmp_path / name / "checkpoints")


def model_of(path):
    """The checkpoint's model, whole, in one process (a sharded one's shards read back together)."""
    model = instantiate(load_frozen(path.parent.parent).model)
    ckpt.load_model_state(model, path)
    return model.state_dict()


def test_a_replicated_jobs_background_checkpoints_hold_what_the_synchronous_ones_hold(tmp_path):
    # 30 MB of state: its write outlasts the steps after it, which change the live tensors meanwhile (an unstaged
    # write would hold some of their updates)
    job = ("cluster.procs_per_node=2", "model=mlp", "model.hidden=1024", "model.depth=4")
    written = {name: trained(tmp_path, name, *job) for name in ("sync", "async")}
    assert (
        [p.name for p in written["async"]]
        == [p.name for p in written["sync"]]
        == [f"step-{s:08d}.pt" for s in (4, 8, 12)]
    )
    for a, s in zip(written["async"], written["sync"]):
        saved_async, saved_sync = ckpt.read(a), ckpt.read(s)  # (each verified against its sha256)
        saved_async.pop("config"), saved_sync.pop("config")  # (the run dir and this key differ)
        same(saved_async, saved_sync, a.name)


def test_a_sharded_jobs_background_checkpoints_hold_what_the_synchronous_ones_hold(tmp_path):
    job = ("+cluster=sim", "cluster.procs_per_node=2", "comm.reducer=fsdp", "model=mlp")
    written = {name: trained(tmp_path, name, *job) for name in ("sync", "async")}
    assert [p.name for p in written["async"]] == [f"step-{s:08d}" for s in (4, 8, 12)]
    for a, s in zip(written["async"], written["sync"]):
        same(model_of(a), model_of(s), a.name)
        for rank in range(4):
            same(ckpt.read(rank_state(a, rank)), ckpt.read(rank_state(s, rank)), f"{a.name} rank {rank}")
