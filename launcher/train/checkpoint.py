"""Checkpoints that survive a crash mid-write and load anywhere.

- Rank 0 writes ``checkpoints/step-XXXXXXXX.pt`` to a temp file in the same directory, fsyncs, then renames:
  a reader sees the old file or the new one, never half of one.
- A checkpoint holds the model (without ``module.``), optimiser, scheduler, position (step, epoch, batch in
  epoch), every rank's RNG states and the resolved config.
- A sharded job's checkpoint is a directory (``launcher.train.sharded``): here its ``train.pt`` (all of the above
  but the model and optimiser, which DCP's files hold shard by shard) is what is read, verified with every rank's
  own file; listed only once complete (``launcher.base.checkpoint_names``).
- Loading maps tensors to the current device (``map_location``: a GPU checkpoint loads on a CPU box) and accepts
  state dicts saved from ``DataParallel``/DDP (``module.``) or ``torch.compile`` (``_orig_mod.``) wrappers.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from launcher.base.checkpoint_names import TRAIN_STATE, is_sharded, leftovers, list_checkpoints
from launcher.base.files import atomic_file, write_atomic
from launcher.group import helpers as rank_helpers

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Writes:
    """File wrapper for torch.save that hashes what it writes (the sha256 sidecar, without reading the file
    back) and keeps the OSError of a failed write (ENOSPC, EDQUOT, EIO): torch's zip writer reports it as
    "unexpected pos"."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha256 = f, hashlib.sha256()
        self.error: Optional[OSError] = None

    def write(self, data: bytes) -> int:
        try:
            written = self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.sha256.update(memoryview(data)[:written])
        return written

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as exc:
            self.error = exc
            raise


def save_atomic(state: Mapping[str, Any], path: Path) -> Path:
    """torch.save through ``files.atomic_file`` (fsync, rename over ``path``); the sha256 sidecar is written
    before the rename, so a checkpoint never appears without its digest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_file(path) as f:
            out = _Writes(f)
            try:
                torch.save(dict(state, format_version=FORMAT_VERSION), out)  # type: ignore[arg-type]  # a file-like
            except Exception:  # the zip writer's error hides a failed write ("unexpected pos"): the write's says why
                if out.error is None:
                    raise
                raise out.error from None
            write_atomic(_digest_path(path), out.sha256.hexdigest() + "\n")
    except BaseException:
        if not path.exists():
            _digest_path(path).unlink(missing_ok=True)
        raise
    return path


def verify(path: Path) -> None:
    """Raise ``ValueError`` naming the file if its bytes differ from the sha256 written with it."""
    digest = _digest_path(path)
    if digest.exists() and digest.read_text().strip() != _sha256(path):
        raise ValueError(f"checkpoint {path} is corrupted (sha256 differs from {digest.name})")


def read(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A checkpoint's training state, verified: the file, or a sharded checkpoint's ``train.pt`` (its model and
    optimiser stay in DCP's files until every rank loads its shard) with every rank's own file checked too."""
    if not is_sharded(path):
        verify(path)
        return load(path, map_location)
    for part in sorted(path.glob("*.pt")):
        verify(part)
    return load(path / TRAIN_STATE, map_location)


def load_newest_valid(directory: Path, map_location: str | torch.device = "cpu") -> tuple[Path | None, dict | None]:
    """The newest checkpoint that verifies and loads; each one skipped is logged with the reason."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, read(path, map_location)
        except Exception as exc:  # truncated, corrupted, unreadable: fall back to the previous one
            log.warning("skipping checkpoint %s: %s", path, str(exc).splitlines()[0])
    return None, None


def prune(directory: Path, keep: int, step: Optional[int] = None) -> None:
    """Delete all but the newest ``keep`` checkpoints, and what sharded writes cut short left up to ``step`` (the
    checkpoint just made whole: a later step's ``.tmp`` may be another rank's write already under way, in the
    background)."""
    for old in list_checkpoints(directory)[:-keep]:
        remove(old)
    clear_leftovers(directory, step)


def clear_leftovers(directory: Path, upto: Optional[int] = None) -> None:
    """Sharded checkpoints' directories a write or a replacement cut short left (``.tmp``, ``.old``): rank 0's, when
    no write is under way (at the start: every one), or up to the step a checkpoint was just made whole at."""
    for path in leftovers(directory, upto):
        remove(path)


def remove(path: Path) -> None:
    """A checkpoint file with its digest, or a sharded checkpoint's directory."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
        _digest_path(path).unlink(missing_ok=True)


def load(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint (or a bare state dict) with every tensor on ``map_location``."""
    return torch.load(path, map_location=map_location, weights_only=True)


def strip_prefixes(state_dict: Mapping[str, Any], prefixes: tuple[str, ...] = WRAPPER_PREFIXES) -> dict[str, Any]:
    """Remove wrapper prefixes (``module.`` from DataParallel/DDP, ``_orig_mod.`` from torch.compile), at any
    depth of nesting, so the keys match a plain model."""
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in prefixes:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
        out[key] = value
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DataParallel / DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def load_model_state(
    model: nn.Module, source: str | Path | Mapping[str, Any], map_location: Optional[str | torch.device] = None
) -> None:
    """Load weights into ``model`` (wrapped or not) from a checkpoint file, a checkpoint dict or a bare state
    dict, whatever wrapper prefixes it was saved with and whichever device it was saved on; or from a sharded
    checkpoint's directory into a plain model (``load_sharded_model``)."""
    if isinstance(source, (str, Path)) and is_sharded(Path(source)):
        load_sharded_model(unwrap(model), Path(source))
        return
    if map_location is None:
        map_location = next(model.parameters()).device
    state = load(source, map_location) if isinstance(source, (str, Path)) else source
    if "model" in state and isinstance(state["model"], Mapping):
        state = state["model"]
    unwrap(model).load_state_dict(strip_prefixes(state))


def load_sharded_model(model: nn.Module, path: Path) -> None:
    """A sharded job's model, whole, into a plain ``model`` in this one process (no process group needed): DCP
    assembles every rank's shards (``dcp_index.whole_model``; the checkpoint's names are the plain model's)."""
    from launcher.train.dcp_index import whole_model  # (here: only a sharded checkpoint needs DCP)

    model.load_state_dict(whole_model(path))


def resume_source(mode: str, ckpt_dir: Path, device: torch.device) -> tuple[Optional[Path], Optional[dict]]:
    """(path, state) to resume from under ``train.resume=mode``: the newest checkpoint that verifies (auto,
    force), the one named, or none (never)."""
    if mode == "never":
        return None, None
    if mode in ("auto", "force"):
        return load_newest_valid(ckpt_dir, map_location=device)
    return Path(mode), read(Path(mode), map_location=device)


def agreed_resume_source(
    mode: str, ckpt_dir: Path, device: torch.device, peers: rank_helpers.Peers = rank_helpers.Peers()
) -> tuple[Optional[Path], Optional[dict]]:
    """Rank 0's choice on every rank (collective): ranks that saw the checkpoint directory differently (a shared
    file system lagging) would otherwise resume from different steps or measure different bucket layouts."""
    path, state = resume_source(mode, ckpt_dir, device)
    mine = str(path) if path is not None else None
    chosen = peers.broadcast_object(mine)
    if chosen != mine:
        log.warning("resuming from rank 0's choice %s instead of %s", chosen, mine)
        path = Path(str(chosen)) if chosen is not None else None
        state = read(path, map_location=device) if path is not None else None
    return path, state
