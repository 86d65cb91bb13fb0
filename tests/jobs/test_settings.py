"""Settings docs/configuration.md documents, each exercised for real: linear lr scaling, IDX data files, the
initial-weights check, refused sbatch keys."""

import gzip
import struct

import numpy as np
import pytest
import torch
from torch import nn

from harness.config import plan
from harness.ranks import spawn_ranks
from harness.run import run_launcher
from launcher.config import ConfigError, DataConfig, OptimConfig
from launcher.train.data import build_datasets
from launcher.train.model import check_same_weights
from launcher.train.optim import build_optimizer


@pytest.mark.parametrize("scaling, world, expected", [("none", 4, 0.05), ("linear", 4, 0.2), ("linear", 1, 0.05)])
def test_linear_lr_scaling_multiplies_by_the_world_size(scaling, world, expected):
    optimizer = build_optimizer(OptimConfig(lr=0.05, lr_scaling=scaling), nn.Linear(2, 2), world)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def write_idx(path, array: np.ndarray, code: int, compress: bool) -> None:
    """An IDX file as MNIST ships them: zero, dtype code, ndim, big-endian dims, data."""
    raw = struct.pack(">HBB", 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_files_load_as_images_and_labels(tmp_path, compress):
    gen = np.random.default_rng(0)
    images = {n: gen.integers(0, 256, (n, 28, 28), dtype=np.uint8) for n in (60, 12)}
    labels = {n: gen.integers(0, 10, n, dtype=np.uint8) for n in (60, 12)}
    write_idx(tmp_path / "train-images-idx3-ubyte", images[60], 0x08, compress)
    write_idx(tmp_path / "train-labels-idx1-ubyte", labels[60], 0x08, compress)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", images[12], 0x08, compress)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[12], 0x08, compress)
    train, test = build_datasets(DataConfig(name="idx", path=str(tmp_path)))
    x, y = train.tensors
    assert x.shape == (60, 1, 28, 28) and x.dtype == torch.float32 and y.tolist() == labels[60].tolist()
    pixels = torch.from_numpy(images[60]).float() / 255  # standardised with the training split's statistics
    torch.testing.assert_close(x[7, 0], (pixels[7] - pixels.mean()) / pixels.std())
    assert test.tensors[0].shape == (12, 1, 28, 28)


def test_digits_are_scikit_learns_split_by_class_in_proportion():
    from sklearn.datasets import load_digits  # the reference: our loader reads its file without importing it

    bunch = load_digits()
    train, test = build_datasets(DataConfig(name="digits", image_size=8))
    x = torch.cat([train.tensors[0], test.tensors[0]])[:, 0]
    y = torch.cat([train.tensors[1], test.tensors[1]])
    assert len(test) == 360 and len(train) == 1437  # ceil(0.2 x 1797) held out
    # every image with its label, once (standardised with the training split's mean and std: undo that on ours)
    pairs = lambda images, labels: sorted(  # noqa: E731
        (tuple(torch.round(img * 1e3).flatten().tolist()), int(label)) for img, label in zip(images, labels)
    )
    ref = torch.from_numpy(bunch.images).float() * (x.flatten().std() / torch.from_numpy(bunch.images).float().std())
    assert pairs(ref - ref.mean() + x.mean(), bunch.target) == pairs(x, y)
    held_out = torch.bincount(test.tensors[1], minlength=10).tolist()
    expected = torch.bincount(torch.from_numpy(bunch.target), minlength=10) * 0.2
    assert all(abs(h - e) < 1 for h, e in zip(held_out, expected.tolist())), (held_out, expected)


def test_idx_job_trains_end_to_end(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    gen = np.random.default_rng(1)
    for prefix, n in (("train", 128), ("t10k", 32)):
        write_idx(data / f"{prefix}-images-idx3-ubyte", gen.integers(0, 256, (n, 28, 28), dtype=np.uint8), 0x08, True)
        write_idx(data / f"{prefix}-labels-idx1-ubyte", gen.integers(0, 10, n, dtype=np.uint8), 0x08, True)
    result = run_launcher("data=idx", f"data.path={data}", "train.max_steps=4", run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 4 steps" in result.stderr


def test_missing_idx_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\[\.gz\] not found in data.path="):
        build_datasets(DataConfig(name="idx", path=str(tmp_path)))


def _different_weights(rank, world, out_dir):
    torch.manual_seed(rank)  # a seeding bug: every rank its own weights
    with pytest.raises(RuntimeError, match=r"initial weights differ from rank 0 on ranks \[1, 2\]"):
        check_same_weights(nn.Linear(4, 4))
    torch.manual_seed(0)
    check_same_weights(nn.Linear(4, 4))  # the same seed: no error


def test_initial_weights_checksum_names_the_ranks_that_differ(tmp_path):
    spawn_ranks(_different_weights, 3, tmp_path)


@pytest.mark.parametrize("key", ["nodes", "ntasks-per-node", "gres", "time", "job_name".replace("_", "-")])
def test_extra_sbatch_refuses_keys_the_launcher_derives(key):
    with pytest.raises(ConfigError, match=rf"cluster.extra_sbatch sets \['{key}'\], which the launcher derives"):
        plan("+cluster=slurm", f"+cluster.extra_sbatch.{key}=1")


@pytest.mark.parametrize("allowed, done", [(0, 0), (2, 2)])
def test_a_preemption_beyond_max_requeues_is_not_requeued_and_says_how_to_resume(tmp_path, allowed, done):
    """The requeue decision rank 0 takes after the stop checkpoint (the requeue itself runs in
    test_slurm.py::test_preemption_twice_requeues_and_resumes_bit_identical)."""
    import json

    from launcher.base.env import DistEnv
    from launcher.launch.slurm.task_entry import requeue

    job, _ = plan("+cluster=slurm", f"cluster.max_requeues={allowed}", run_dir=tmp_path)
    if done:
        (tmp_path / "requeues.json").write_text(json.dumps({"count": done}))
    with pytest.raises(RuntimeError) as info:
        requeue(job, DistEnv(launch_id="17", source="slurm"), RuntimeError("stopped at step 15 on SIGUSR2"))
    assert str(info.value) == (
        f"stopped at step 15 on SIGUSR2; not requeued: cluster.max_requeues={allowed} reached. HINT: resubmit with "
        f"hydra.run.dir={tmp_path} to resume from the checkpoint"
    )
