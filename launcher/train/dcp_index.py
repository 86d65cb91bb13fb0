"""Reading a sharded checkpoint's DCP files without trusting them more than the rest of a checkpoint: DCP's
``.metadata`` (its index: every entry's shape, dtype and where each shard lies) is a pickle with no checksum, and
torch's own reader unpickles whatever it holds. Here it is built by an unpickler that knows only DCP's index
classes, torch's sizes, dtypes and layouts, and paths (``read_index``), and every DCP load of the launcher reads
through it (``IndexReader``): a resume (``sharded.load_shards``), the resharding check (``reshard``), the model alone
in one process (``whole_model``: ``checkpoint.load_model_state``, ``python -m launcher export``). The shards
themselves are read by DCP with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from launcher.base.checkpoint_names import DCP_METADATA

_INDEX = "torch.distributed.checkpoint.metadata"  # DCP's index classes: what a .metadata pickle may build
_INDEX_CLASSES = ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata"]
_INDEX_CLASSES += ["TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"]
_INDEX_GLOBALS = {(_INDEX, name) for name in _INDEX_CLASSES} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # (a layout by its name)
    ("pathlib", "PosixPath"),  # (the checkpoint_id it was written to)
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


def read_index(path: Path) -> Metadata:
    """DCP's ``.metadata`` of the sharded checkpoint ``path``, built by ``_IndexUnpickler``; ``ValueError`` naming
    the file when it is not DCP's index."""
    index = path / DCP_METADATA
    try:
        with open(index, "rb") as f:
            metadata = _IndexUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"{index} is not DCP's index of a checkpoint ({exc}); HINT: an earlier checkpoint (train.resume=PATH, "
            "or export's --step)"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{index} holds a {type(metadata).__name__}, not DCP's index; HINT: an earlier checkpoint")
    if getattr(metadata, "storage_meta", None) is None:  # (older DCP versions wrote none)
        metadata.storage_meta = StorageMeta()
    return metadata


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's index classes, torch's sizes, dtypes and layouts, and paths; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INDEX_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to build {module}.{name}: not part of DCP's index")


class IndexReader(dcp.FileSystemReader):
    """DCP's file-system reader of ``path``, its index read by ``read_index`` (once) instead of torch's unpickling."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.index = read_index(Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.index.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # (read_index sets one)
        return self.index


def _model_entries(index: Metadata) -> dict[str, Any]:
    return {k.removeprefix("model."): m for k, m in index.state_dict_metadata.items() if k.startswith("model.")}


def model_shapes(index: Metadata) -> dict[str, tuple[int, ...]]:
    """The model's tensors in a checkpoint's index, by name (without ``model.``), with their whole shapes."""
    return {k: tuple(m.size) for k, m in _model_entries(index).items() if isinstance(m, TensorStorageMetadata)}


def whole_model(path: Path) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's model tensors, each assembled whole on the CPU from every rank's shards by DCP in this
    one process (no process group); the optimiser's entries are never read."""
    reader = IndexReader(path)
    entries = _model_entries(reader.index)
    other = [k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata)]
    if other:
        raise ValueError(f"checkpoint {path}: the model's {other} are not tensors; only tensors are read whole")
    state = {"model": {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}}
    with warnings.catch_warnings():  # (DCP warns that it reads in one process: asked for)
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]
