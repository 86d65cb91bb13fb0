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


def test_a_rank_killed_while_a_checkpoint_is_written_leaves_the_previous_one_newest(tmp_path):
    """A sharded job writing in the background: step 4's checkpoint is held before rank 0 renames it whole (its
    shards written: ``LAUNCHER_FAULT``'s ``write``), and rank 0 is killed at step 5 meanwhile. The half-made
    ``step-4.tmp`` is never taken for a checkpoint: the restart resumes from step 2 (and clears the leftover), the
    end waits for the last write in flight and says so, and the model is the uninterrupted run's."""
    job = ("cluster.procs_per_node=2", "comm.reducer=fsdp", "train.max_steps=8", "train.checkpoint_every_steps=2")
    job += ("train.log_every_steps=2", "train.checkpoint_async=true")
    held = "step=4,rank=0,write=60,attempt=0;step=5,rank=0,signal=KILL,attempt=0;step=8,rank=0,write=1,attempt=1"
    run = tmp_path / "killed"
    result = run_launcher(*job, "cluster.max_restarts=1", run_dir=run, env={"LAUNCHER_FAULT": held})
    err = result.stderr
    assert result.returncode == 0, err[-3000:]
    assert "the checkpoint of step 4 waits 60 s before it is made whole" in (run / "logs" / "rank-0.log").read_text()
    assert f"resumed from {run}/checkpoints/step-00000002 at step 2" in err, err[-3000:]
    assert "the end of the run waits for the checkpoint of step 8 being written" in err, err[-3000:]
    assert [p.name for p in list_checkpoints(run / "checkpoints")][-1] == "step-00000008"
    assert not list((run / "checkpoints").glob("*.tmp")), "a write cut short left its directory"
    whole = run_launcher(*job, run_dir=tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    newest = {name: list_checkpoints(tmp_path / name / "checkpoints")[-1] for name in ("killed", "whole")}
    same(model_of(newest["killed"]), model_of(newest["whole"]), "step 8")
