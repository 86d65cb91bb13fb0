"""Data sets (no download ever) and the distributed loaders that shard them.

- ``digits``: scikit-learn's bundled 8x8 digits (real handwriting), fixed stratified split, upsampled.
- ``synthetic``: random images labelled by a fixed random linear teacher (learnable), any shape and size.
- ``idx``: MNIST / Fashion-MNIST IDX files (optionally .gz) from a local directory.
- your own: ``data._target_`` names a factory returning (train, test) map-style Datasets (``user_datasets``).

Data is prepared once on the CPU, as tensors, and moved to the device one batch at a time (the d2l notes' advice).
"""

from __future__ import annotations

import gzip
import importlib.util
import struct
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import Any, Optional, cast

import numpy as np
import torch
from hydra.utils import get_method
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from launcher.config import DataConfig
from launcher.train.batch import collate

IMAGE_MODELS = ("models.lenet.LeNet", "models.mlp.MLP", "models.resnet.resnet18")  # conf/model: they take images
DATA_SEED = 20240601  # fixed: the data set itself must not depend on train.seed or the rank


def build_datasets(cfg: DataConfig, images: bool = True) -> tuple[Dataset, Optional[Dataset]]:
    """(train, test): the user's own (``data._target_``; with ``images``, for a built-in model, checked against the
    shape the config describes), or a built-in set as tensors of shape (N, channels, image_size, image_size) and
    int64 labels."""
    if cfg._target_ is not None:
        return user_datasets(cfg, images)
    loaders = {"digits": _digits, "synthetic": _synthetic, "idx": _idx}
    x_train, y_train, x_test, y_test = loaders[cfg.name](cfg)
    x_train, x_test = (_shape(x, cfg) for x in (x_train, x_test))
    mean, std = x_train.mean(), x_train.std().clamp_min(1e-6)
    return TensorDataset((x_train - mean) / std, y_train), TensorDataset((x_test - mean) / std, y_test)


def _shape(x: torch.Tensor, cfg: DataConfig) -> torch.Tensor:
    """Resize to image_size (bilinear) and repeat grey images to the requested channels."""
    if x.shape[-1] != cfg.image_size:
        x = F.interpolate(x, size=(cfg.image_size, cfg.image_size), mode="bilinear", align_corners=False)
    if x.shape[1] != cfg.channels:
        if x.shape[1] != 1:
            raise ValueError(f"data.channels={cfg.channels} but {cfg.name} images have {x.shape[1]} channels")
        x = x.expand(-1, cfg.channels, -1, -1)
    return x.contiguous()


Arrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (x_train, y_train, x_test, y_test)


def _digits(cfg: DataConfig) -> Arrays:
    images, labels = digits_arrays()
    train, test = stratified_split(labels, cfg.test_fraction)
    as_x = lambda i: torch.from_numpy(images[i]).unsqueeze(1)  # noqa: E731
    as_y = lambda i: torch.from_numpy(labels[i])  # noqa: E731
    return as_x(train), as_y(train), as_x(test), as_y(test)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, read from its file without importing scikit-learn (whose import costs every
    rank about 1.4 s of CPU): images (1797, 8, 8) float32 in [0, 1], labels int64."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("data.name=digits reads scikit-learn's bundled digits: pip install scikit-learn")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    return (table[:, :-1] / 16.0).reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) indices: ceil(test_fraction x N) test samples, each class held out in proportion (largest
    remainders, ties to the lower class), the picks within a class drawn with the fixed DATA_SEED."""
    classes, counts = np.unique(labels, return_counts=True)
    n_test = int(np.ceil(test_fraction * len(labels)))
    exact = counts * n_test / len(labels)
    per_class = np.floor(exact).astype(np.int64)
    order = sorted(range(len(classes)), key=lambda c: (-(exact[c] - per_class[c]), c))
    per_class[order[: n_test - int(per_class.sum())]] += 1
    g = torch.Generator().manual_seed(DATA_SEED)
    train, test = [], []
    for c, k in zip(classes, per_class):
        members = np.flatnonzero(labels == c)
        members = members[torch.randperm(len(members), generator=g).numpy()]
        test.append(members[:k])
        train.append(members[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _synthetic(cfg: DataConfig) -> Arrays:
    g = torch.Generator().manual_seed(DATA_SEED)
    n = cfg.train_samples + cfg.test_samples
    x = torch.randn(n, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    teacher = torch.randn(x[0].numel(), cfg.num_classes, generator=g)
    y = (x.flatten(1) @ teacher).argmax(1)
    k = cfg.train_samples
    return x[:k], y[:k], x[k:], y[k:]


IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def _idx(cfg: DataConfig) -> Arrays:
    root = Path(cfg.path or ".")
    arrays = {key: read_idx(_find(root, name)) for key, name in IDX_FILES.items()}
    as_x = lambda a: torch.from_numpy(a.astype(np.float32) / 255.0).unsqueeze(1)  # noqa: E731
    as_y = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
    return as_x(arrays["x_train"]), as_y(arrays["y_train"]), as_x(arrays["x_test"]), as_y(arrays["y_test"])


def _find(root: Path, name: str) -> Path:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{name}[.gz] not found in data.path={str(root)!r}; HINT: point data.path at the IDX files")


_IDX_DTYPES: dict[int, Any] = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (the MNIST format): magic 0x0000 | dtype | ndim, big-endian dims, then the data."""
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (magic {raw[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    return np.frombuffer(raw, dtype=np.dtype(_IDX_DTYPES[dtype_code]), offset=4 + 4 * ndim).reshape(dims)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way (after ``skip`` of this rank's samples) on resume."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def user_datasets(cfg: DataConfig, images: bool = True) -> tuple[Dataset, Optional[Dataset]]:
    """``data._target_(**data.kwargs)`` -> (train, test or None), map-style. ``images`` (a built-in model, which
    takes images): the first sample of each must be an image of the shape data.channels / data.image_size describe,
    its first and last labels below data.num_classes. Otherwise samples of any shape: the loss checks what it gets
    at the first step (``task.py``)."""
    assert cfg._target_ is not None
    return checked_datasets(cfg, get_method(cfg._target_)(**cfg.kwargs), images)


def checked_datasets(cfg: DataConfig, made: Any, images: bool = True) -> tuple[Dataset, Optional[Dataset]]:
    """What ``data._target_`` returned (``made``), checked as ``user_datasets`` says: (train, test or None)."""
    where = f"data._target_={cfg._target_!r}"
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ValueError(f"{where} returned a {type(made).__name__}; HINT: return (train, test) Datasets (test: None)")
    for split, dataset in zip(("train", "test"), made):
        if dataset is None and split == "test":
            continue
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) or len(dataset) == 0:
            raise ValueError(f"{where}: its {split} set is not a non-empty map-style Dataset (__getitem__, __len__)")
        first = dataset[0]
        if not images:
            continue
        x = first[0]
        want = (cfg.channels, cfg.image_size, cfg.image_size)
        shape = tuple(torch.as_tensor(x).shape)
        if shape != want:
            fix = f"data.channels={shape[0]} data.image_size={shape[-1]}" if len(shape) == 3 else "(C, H, W) images"
            raise ValueError(
                f"{where}: the first {split} sample has shape {shape}, but data.channels={cfg.channels} "
                f"data.image_size={cfg.image_size} describe {want} to the model; HINT: {fix}"
            )
        last = dataset[len(dataset) - 1] if len(dataset) > 1 else first
        for index, sample in ((0, first), (len(dataset) - 1, last)):  # sorted data sets end with the highest label
            label = int(torch.as_tensor(sample[1]))
            if not 0 <= label < cfg.num_classes:
                raise ValueError(
                    f"{where}: {split} sample {index} has label {label}, outside [0, data.num_classes="
                    f"{cfg.num_classes}); HINT: set data.num_classes to the number of classes"
                )
    return made[0], made[1]


def train_loader(
    dataset: Dataset,
    batch_per_rank: int,
    rank: int,
    world: int,
    seed: int,
    workers: int = 0,
    pin: bool = False,
    shuffle: bool = True,
) -> DataLoader:
    """Each rank sees a disjoint 1/world of every epoch, reshuffled by ``set_epoch`` (``shuffle``); partial batches
    dropped so every rank takes the same number of steps."""
    sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, seed=seed, shuffle=shuffle)
    if len(sampler) < batch_per_rank:
        raise ValueError(
            f"{len(cast(Sized, dataset))} training samples give each of {world} ranks {len(sampler)} samples, fewer "
            f"than its batch of {batch_per_rank}; HINT: lower train.batch_size"
        )
    # A private generator: iterating the loader must not draw from the global RNG (bit-identical resume).
    generator = torch.Generator().manual_seed(seed + rank)
    return DataLoader(
        dataset,
        batch_size=batch_per_rank,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate,  # any structure of tensors, dataclasses too (batch.py)
        generator=generator,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
    )


def eval_loader(
    dataset: Optional[Dataset], batch_size: int, rank: int, world: int, workers: int = 0, pin: bool = False
) -> Optional[DataLoader]:
    """Rank r evaluates samples r, r+world, ... : every sample exactly once across ranks (no padding). None
    without a held-out split."""
    if dataset is None:
        return None
    shard = Subset(dataset, range(rank, len(cast(Sized, dataset)), world))  # (map-style: user_datasets checks)
    generator = torch.Generator().manual_seed(rank)
    return DataLoader(
        shard, batch_size=batch_size, collate_fn=collate, generator=generator, num_workers=workers, pin_memory=pin
    )
