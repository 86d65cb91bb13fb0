"""Issue 49 (item 4): a sharded job's checkpoints (``comm.reducer=fsdp``) are written without gathering: every
rank writes its own shards with torch.distributed.checkpoint into ``checkpoints/step-N/`` (and its own RNG state,
log window and compression state beside them), and the job resumes from them bit for bit on the same layout: a run
stopped by SIGTERM and run again ends with the parameters and the logged losses of the run never stopped, with
PowerSGD's per-rank error feedback across two (virtual) nodes too. Retention, the stop line's resume command and a
job whose model is not the checkpoint's refusing it, naming what differs (on other layouts and reducers:
tests/jobs/test_reshard.py). (The directory's rules in one process:
tests/rules/test_sharded_checkpoint.py, test_checkpoint_names.py.)"""

import json
import re
import shutil
import subprocess

import pytest
import torch
from hydra.utils import instantiate

from harness.ranks import train_layout
from harness.run import run_launcher
from launcher.base.checkpoint_names import list_checkpoints, rank_state, sharded_path
from launcher.config import load_frozen
from launcher.train import checkpoint as ckpt

pytestmark = pytest.mark.slow
FSDP = ("comm.reducer=fsdp", "comm.fsdp_min_params=1000", "model=mlp")  # the MLP's layers each a unit
JOB = (*FSDP, "train.max_steps=12", "train.checkpoint_every_steps=4", "train.log_every_steps=4")
JOB += ("train.keep_checkpoints=2", "cluster.procs_per_node=2", "train.threads_per_rank=1")
STOP = {"LAUNCHER_FAULT": "step=6,signal=TERM,target=parent"}  # rank 0 signals the launcher before step 6


def train_records(run_dir):
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [{k: r[k] for k in ("step", "epoch", "loss", "lr")} for r in lines if r["kind"] == "train"]


def final_model(run_dir):
    """The newest checkpoint's model, whole, in this process (from every rank's shards)."""
    model = instantiate(load_frozen(run_dir).model)
    ckpt.load_model_state(model, list_checkpoints(run_dir / "checkpoints")[-1])
    return model.state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = run_launcher(*JOB, run_dir=run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_each_rank_writes_its_shard_and_a_stopped_job_resumes_bit_identical(tmp_path, uninterrupted):
    stopped = run_launcher(*JOB, run_dir=tmp_path, env=STOP)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    newest = list_checkpoints(tmp_path / "checkpoints")[-1]
    step = int(newest.name.removeprefix("step-"))
    assert 6 <= step < 12 and step % 4 and newest == sharded_path(tmp_path / "checkpoints", step), newest  # mid-window
    assert f"the newest checkpoint is {newest} (step {step}): run again with hydra.run.dir={tmp_path}" in stopped.stderr
    files = sorted(p.name for p in newest.iterdir() if not p.name.endswith(".sha256"))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "own-0.pt", "own-1.pt", "train.pt"], files
    train = ckpt.read(newest)  # the position and schedule only: no rank holds the whole model to write it
    assert "model" not in train and "optimizer" not in train and train["step"] == step, sorted(train)
    windows = [ckpt.read(rank_state(newest, r))["log_window"] for r in range(2)]  # each rank's own part
    assert [w["from_step"] for w in windows] == [step - step % 4] * 2, windows
    assert windows[0]["sums"] != windows[1]["sums"], windows  # (each rank's own losses)
    (tmp_path / "checkpoints" / "step-00000099.tmp").mkdir()  # a write some crash cut short: cleared at start

    resumed = run_launcher(run_dir=tmp_path)  # the stop line's command: the run dir alone
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {newest} at step {step}" in resumed.stderr, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["resumed_from"] == str(newest)
    assert train_records(tmp_path) == train_records(uninterrupted)  # every logged loss and lr, to the bit
    ours, theirs = final_model(tmp_path), final_model(uninterrupted)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs), "the resumed run's parameters differ"
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step-00000008", "step-00000012"], kept  # train.keep_checkpoints=2 directories, nothing else


def test_a_job_whose_model_is_not_the_checkpoints_refuses_it_naming_what_differs(tmp_path, uninterrupted):
    """train.resume=force passes the config's check (another model.*): every rank refuses the shards before loading
    any, with the tensors that differ and the fix."""
    shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
    newest = list_checkpoints(tmp_path / "checkpoints")[-1]
    result = run_launcher(*JOB, "model.hidden=128", "train.max_steps=16", "train.resume=force", run_dir=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        f"cannot resume checkpoint {newest}: its model is not this job's (of another shape: net.1.bias [256] saved, "
        "[128] here, net.1.weight [256, 784] saved, [128, 784] here, net.3.bias [256] saved, [128] here, net.3.weight "
        "[256, 256] saved, [128, 128] here and 1 more); HINT: resume it with the model settings"
    ) in result.stderr, result.stderr[-3000:]


@pytest.fixture
def small_disk(tmp_path):
    """A 3.5 MB file system: room for one sharded checkpoint of the MLP (its shards and momentum, ~2.2 MB) and the
    run's logs, not for two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3500k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); needs root")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_names_the_rank_that_could_not_write_and_keeps_the_previous_checkpoint(small_disk):
    """DCP writes each shard with torch.save, which says only "unexpected pos" when the disk is full: the message
    says what the system said, the rank, and the checkpoint that is still whole; nothing half-written is left."""
    run_dir = small_disk / "run"
    job = (*FSDP, "train.max_steps=20", "train.checkpoint_every_steps=10", "train.keep_checkpoints=1")
    result = run_launcher(*job, "cluster.procs_per_node=2", run_dir=run_dir)
    assert result.returncode == 1, result.stderr[-3000:]
    kept = sharded_path(run_dir / "checkpoints", 10)
    assert re.search(
        r"rank \d on \S+: cannot write checkpoint \S+step-00000020 at step 20 "
        r"\(No space left on device \(rank \d\)\); "
        rf"the previous checkpoint {re.escape(str(kept))} is intact; HINT: free space in ",
        result.stderr,
    ), result.stderr[-3000:]
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]  # no step-00000020.tmp
    assert ckpt.read(kept)["step"] == 10  # whole: its checksums hold


COMPRESSED = ("comm.shard=node", "comm.compress=powersgd", "comm.compress_warmup_steps=1", "comm.powersgd_rank=2")
SPAN = ("optim.schedule_steps=12", "train.checkpoint_every_steps=6", "train.threads_per_rank=1")


def test_a_compressed_sharded_job_on_two_nodes_resumes_bit_identical(tmp_path):
    """2 virtual nodes x 2 ranks, each node's ranks sharding the model, PowerSGD across nodes: 12 steps straight,
    against 6 then 6 more from the checkpoint. Each rank's error feedback (its shard's) is its own file."""
    job = (*FSDP, *COMPRESSED, *SPAN)
    straight = train_layout(tmp_path / "straight", "2x2", *job, "train.max_steps=12")
    train_layout(tmp_path / "stopped", "2x2", *job, "train.max_steps=6")
    saved = sharded_path(tmp_path / "stopped" / "run" / "checkpoints", 6)
    assert all((saved / f"__{r}_0.distcp").is_file() for r in range(4)), sorted(saved.iterdir())
    errors = [ckpt.read(rank_state(saved, r))["compression"]["errors"] for r in range(4)]
    assert all(errors) and not torch.equal(errors[0][0], errors[1][0])  # a shard's each: not one gathered state
    resumed = train_layout(tmp_path / "stopped", "2x2", *job, "train.max_steps=12")
    assert resumed[0]["summary"]["resumed_from"] == str(saved)
    for rank, result in enumerate(resumed):
        for name, value in straight[rank]["params"].items():
            assert torch.equal(result["params"][name], value), (rank, name)
