"""``python -m launcher export RUN_DIR [--step N] OUT``: the model alone, as one ``state_dict`` file anything can load
without the launcher: ``Model(**kwargs).load_state_dict(torch.load(OUT, weights_only=True))`` (or safetensors', for
an OUT ending ``.safetensors``). A checkpoint is not that file: it holds the optimiser, RNG states and the
position, and a sharded job's (``comm.reducer=fsdp``) is a directory of every rank's shards (DCP's format) that only
torch.distributed reads.

Both kinds are read in this one process, without a process group: a ``step-N.pt``'s ``model`` (prefix-free), or a
``step-N/`` directory's model tensors only (never the optimiser's), each assembled whole on the CPU from every
rank's shards by DCP's single-process load (``no_dist``). Nothing unverified is unpickled: the ``.pt`` files are
checked against their sha256 and read with ``weights_only``; DCP's ``.metadata`` index (a pickle without a
checksum) is read by an unpickler that knows only DCP's index classes, and its shards with ``weights_only``."""

from __future__ import annotations

import ast
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch

from launcher.base.checkpoint_names import is_sharded, list_checkpoints, step_of
from launcher.base.files import atomic_file, write_atomic
from launcher.base.run_dir import RunDir
from launcher.config import ConfigError, load_frozen
from launcher.train import checkpoint as ckpt

USAGE = "usage: python -m launcher export RUN_DIR [--step N] OUT   (OUT ending .safetensors: safetensors' format)"
EXIT_OK, EXIT_FAILED, EXIT_BAD = 0, 1, 2
SAFETENSORS = ".safetensors"


def export_command(args: list[str]) -> int:
    """The command: what was written and the line of Python that loads it on stdout; a bad argument or checkpoint
    is named with the fix on stderr (exit 2) before any tensor is read, a failed write too (exit 1)."""
    try:
        run_dir, step, out = parse(args)
        path = pick(run_dir, step)
        if out.suffix == SAFETENSORS:
            safetensors_module()
        if out.is_dir():
            raise ValueError(f"OUT {out} is a directory; HINT: name the file to write, e.g. {out / 'model.pt'}")
        state, by_engine = model_state(path)
        written = write_state(state, out, step_of(path) or 0)
    except ValueError as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return EXIT_BAD
    except OSError as exc:
        print(f"launcher: error: cannot write {out}: {exc}; HINT: a writable place with room for it", file=sys.stderr)
        return EXIT_FAILED
    values = sum(t.numel() for t in state.values())
    kind = "safetensors" if out.suffix == SAFETENSORS else "torch.save"
    print(
        f"exported {out} ({kind}, {written:,} bytes): the model at step {step_of(path)}, {len(state)} tensors, "
        f"{values:,} parameters (buffers included), from {path}"
    )
    print("load it with:\n" + (engine_line(out) if by_engine else load_line(run_dir, out)))
    return EXIT_OK


def parse(args: list[str]) -> tuple[Path, Optional[int], Path]:
    """(RUN_DIR, the step or None for the newest, OUT) from ``RUN_DIR [--step N] OUT``."""
    rest, step, args = [], None, list(args)
    while args:
        arg = args.pop(0)
        if arg == "--step" or arg.startswith("--step="):
            value = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            if not value.isdigit():
                raise ValueError(f"--step {value!r} is not a step number; HINT: --step 400 (a checkpoint's step)")
            step = int(value)
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg!r}; {USAGE}")
        else:
            rest.append(arg)
    if len(rest) != 2:
        raise ValueError(f"export takes a run dir and an output file, got {rest}; {USAGE}")
    return Path(rest[0]), step, Path(rest[1])


def pick(run_dir: Path, step: Optional[int]) -> Path:
    """The complete checkpoint at ``step`` (None: the newest) of ``run_dir``; what there is, when it is not."""
    if not run_dir.is_dir():
        near = run_dir.parent
        runs = (
            sorted(p.name for p in near.iterdir() if list_checkpoints(RunDir(p).checkpoints)) if near.is_dir() else []
        )
        there = f"; {near} holds the run dirs {', '.join(runs[-5:])}" if runs else ""
        raise ValueError(
            f"no run dir {run_dir}{there}; HINT: the hydra.run.dir of a run (runs/<date>_<time> by default)"
        )
    directory = RunDir(run_dir).checkpoints
    found = list_checkpoints(directory)
    if not found:
        raise ValueError(
            f"{run_dir} holds no complete checkpoint ({directory} has none): is it a launcher run dir? A run "
            "writes one every train.checkpoint_every_steps and at its end"
        )
    if step is None:
        return found[-1]
    steps = {step_of(p): p for p in found}
    if step not in steps:
        have = ", ".join(str(s) for s in steps)
        raise ValueError(f"{directory} has no checkpoint at step {step}, only at {have}; HINT: --step one of those")
    return steps[step]


def safetensors_module() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError(
            f"an OUT ending {SAFETENSORS} is written in safetensors' format, but the safetensors package is not "
            "installed; HINT: pip install safetensors, or name OUT .pt for torch's own format"
        ) from None
    return safetensors.torch


def model_state(path: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """The model's state dict, whole, plain tensors on the CPU, keys as the model class's ``state_dict()``, and
    whether a user's loop wrote it (``launcher.Engine``: its model is the user's, not the config's). The ``.pt``
    files are verified first (``ckpt.read``: a sharded checkpoint's ``train.pt`` and ``own-<k>.pt`` too)."""
    try:
        state = ckpt.read(path)
    except ValueError as exc:  # corrupted: its sha256 differs
        raise ValueError(f"{exc}; HINT: --step an earlier checkpoint") from None
    model = _whole_sharded(path) if is_sharded(path) else state.get("model")
    if not isinstance(model, Mapping) or not model:
        raise ValueError(f"checkpoint {path} holds no model state; HINT: a checkpoint the launcher's trainer wrote")
    out = {}
    for key, value in ckpt.strip_prefixes(model).items():
        if type(value) is not torch.Tensor:  # (a DTensor, or not a tensor: nothing torch.load(weights_only) takes)
            raise ValueError(f"checkpoint {path}: the model's {key!r} is a {type(value).__name__}, not a tensor")
        out[key] = value.detach().cpu()
    return out, bool(state.get("engine"))


def _whole_sharded(path: Path) -> dict[str, torch.Tensor]:
    from launcher.train.dcp_index import whole_model  # (here: torch.distributed.checkpoint takes 0.6 s to import)

    return whole_model(path)


def write_state(state: dict[str, torch.Tensor], out: Path, step: int) -> int:
    """``state`` into ``out`` (replaced in one step: a reader never sees half of it), torch's format or, for
    ``.safetensors``, safetensors' (which stores no two names over one storage: tied weights are copied); its bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == SAFETENSORS:
        seen: set[int] = set()
        apart = {}
        for key, tensor in state.items():
            shared = tensor.untyped_storage().data_ptr() in seen
            seen.add(tensor.untyped_storage().data_ptr())
            apart[key] = tensor.clone() if shared else tensor.contiguous()
        write_atomic(out, safetensors_module().save(apart, metadata={"step": str(step)}))
    else:
        with atomic_file(out) as f:
            torch.save(state, f)
    return out.stat().st_size


def load_line(run_dir: Path, out: Path) -> str:
    """One line of Python that builds the model class of ``run_dir``'s config and loads ``out`` into it: the class
    called with its arguments where they are plain values, else built by Hydra from the config as the trainer does."""
    load = f"torch.load({str(out)!r}, weights_only=True)"
    imports = "import torch"
    if out.suffix == SAFETENSORS:
        load, imports = f"safetensors.torch.load_file({str(out)!r})", "import safetensors.torch"
    try:
        model = dict(load_frozen(run_dir).model)
    except (ConfigError, OSError):  # (no config.yaml to read: the line that builds it from the file instead)
        model = {}
    target, kwargs = str(model.pop("_target_", "")), model
    if "." in target and all(k.isidentifier() and not k.startswith("_") and _plain(v) for k, v in kwargs.items()):
        module, name = target.rsplit(".", 1)
        call = f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
        return f"{imports}; from {module} import {name}; model = {call}; model.load_state_dict({load})"
    config = str(RunDir(run_dir).config)
    build = f"instantiate(OmegaConf.load({config!r}).model)"
    return f"{imports}; from hydra.utils import instantiate; from omegaconf import OmegaConf; model = {build}; " + (
        f"model.load_state_dict({load})"
    )


def engine_line(out: Path) -> str:
    """The line for a checkpoint a user's loop wrote (``launcher.Engine``): its model class is the user's own."""
    imports, load = "import torch", f"torch.load({str(out)!r}, weights_only=True)"
    if out.suffix == SAFETENSORS:
        imports, load = "import safetensors.torch", f"safetensors.torch.load_file({str(out)!r})"
    return f"{imports}; model = YourModel(); model.load_state_dict({load})  # (the model your loop built)"


def _plain(value: Any) -> bool:
    """A value its ``repr`` gives back (numbers, strings, lists of them), with no Hydra ``_target_`` inside."""
    try:
        return ast.literal_eval(repr(value)) == value and "_target_" not in repr(value)
    except (ValueError, SyntaxError):
        return False
