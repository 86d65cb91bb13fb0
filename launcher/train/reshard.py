"""Resuming a checkpoint on another layout than the one that wrote it: the model and optimiser, whatever kind wrote
them, into whatever this job holds. (The position, schedule and per-rank parts: ``saving``.)

- A sharded checkpoint (``comm.reducer=fsdp``: a directory of DCP's chunks) into a sharded job on any number of
  nodes and ranks, or under the other ``comm.shard``: ``sharded.load_shards`` asks DCP for this rank's new shards, and
  DCP's planner reads, from each saved chunk, only the part this rank's shards overlap: nothing is gathered.
- The same directory into a replicated job (``ddp``, ``bucketed``): the same call, with the plain model's whole
  tensors asked for: every rank reads every chunk (it holds the whole model and optimiser anyway).
- A replicated job's file into a sharded job (``from_whole``): the file holds the model and optimiser whole, and
  every rank has read it already (rank 0's choice of checkpoint is checked by each rank reading it, as for any
  resume): each rank cuts its own shards out of those tensors itself, without a collective (nothing is sent, no
  rank gathers anything), the optimiser's state taken from the file's parameter numbers to the parameters' names
  DCP's functions speak.

A model whose parameters or buffers differ from the checkpoint's, by name or shape, is refused before anything is
loaded (``check_model``), naming them: loading it would stop in DCP's internals, or load part of the model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from launcher.train.checkpoint import strip_prefixes
from launcher.train.dcp_index import model_shapes, read_index
from launcher.train.optim import as_built

Shapes = dict[str, tuple[int, ...]]
SHOWN = 4  # names a refusal lists of each kind (the rest counted)


def dcp_shapes(path: Path) -> Shapes:
    """The model's tensors in a sharded checkpoint, by name, with their whole shapes: DCP's index (``.metadata``,
    read by ``dcp_index``), without reading a shard."""
    return model_shapes(read_index(path))


def file_shapes(weights: Mapping[str, Any]) -> Shapes:
    """A replicated checkpoint's model (``state["model"]``), by name, with the shapes."""
    return {k: tuple(v.shape) for k, v in strip_prefixes(weights).items() if torch.is_tensor(v)}


def check_model(path: Path, model: nn.Module, saved: Shapes) -> None:
    """Raise ``ValueError`` if ``model``'s tensors (a sharded one's by their whole shapes) are not the checkpoint's,
    naming those only in one of them and those of another shape."""
    here = {k: tuple(v.shape) for k, v in model.state_dict().items() if torch.is_tensor(v)}
    if here == saved:
        return
    shaped = [k for k in sorted(here.keys() & saved.keys()) if saved[k] != here[k]]
    differ = [
        _names("only in the checkpoint", sorted(saved.keys() - here.keys())),
        _names("only in this job's model", sorted(here.keys() - saved.keys())),
        _names("of another shape", [f"{k} {list(saved[k])} saved, {list(here[k])} here" for k in shaped]),
    ]
    raise ValueError(
        f"cannot resume checkpoint {path}: its model is not this job's ({'; '.join(d for d in differ if d)}); "
        "HINT: resume it with the model settings of the run that wrote it (its config.yaml), or start over with "
        "train.resume=never or a new hydra.run.dir"
    )


def _names(what: str, names: list[str]) -> str:
    if not names:
        return ""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{what}: {', '.join(names[:SHOWN])}{more}"


def from_whole(
    model: nn.Module, optimizer: torch.optim.Optimizer, weights: Mapping[str, Any], optim_state: Mapping[str, Any]
) -> None:
    """A replicated checkpoint's whole ``weights`` and optimiser state (``optimizer.state_dict()`` of an optimiser
    built as this one is: over the model's parameters, in their order) into the sharded ``model`` and
    ``optimizer``: each rank its own shards, cut here (see the module docstring)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    numbered = [i for group in optim_state["param_groups"] for i in group["params"]]
    if len(numbered) != len(params):
        raise ValueError(
            f"the checkpoint's optimiser holds {len(numbered)} parameters, this job's {len(params)}; HINT: resume it "
            "with the optim settings of the run that wrote it, or start over with train.resume=never"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    name_of = dict(zip(numbered, (names[id(p)] for p in params)))  # the file's number -> the parameter's name
    param_of = dict(zip(numbered, params))
    here = model.state_dict()
    msd = {k: _shard_like(v, here[k]) for k, v in strip_prefixes(weights).items()}
    osd: dict[str, Any] = {
        "state": {
            name_of[i]: {k: _shard_like(v, param_of[i]) for k, v in state.items()}
            for i, state in optim_state["state"].items()
        },
        "param_groups": [dict(g, params=[name_of[i] for i in g["params"]]) for g in optim_state["param_groups"]],
    }
    with as_built(optimizer):
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def _shard_like(value: Any, like: Any) -> Any:
    """``value`` (whole) as this rank's shard of ``like`` (a sharded parameter, or its state), cut locally
    (``src_data_rank=None``: every rank holds ``value`` whole; nothing is scattered); anything else as it is."""
    if isinstance(like, DTensor) and torch.is_tensor(value) and tuple(value.shape) == tuple(like.shape):
        return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return value
