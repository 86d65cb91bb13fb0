"""Which modules of a model FSDP2 shards as units of their own (``comm.fsdp_units``, ``comm.fsdp_min_params``): a
unit's parameters are gathered together before its forward and freed after it, the rest of the model's with the
root's. Children come before parents; a unit never holds a parameter another module outside it shares (tied weights:
FSDP2 refuses a parameter in two units), nor is it a container never called (a ``ModuleList`` has no forward).

The default (neither set) follows torch's own recipe: each block of the model's ``ModuleList``s is a unit (a
transformer's layers: torch's ``nn.TransformerEncoder``, a Hugging Face model's ``encoder.layer`` or ``h``). A block
ends in a residual sum, a fresh tensor; the modules inside it do not: a ``Linear`` on a sequence, an attention, an
``nn.Sequential`` ending in either returns a view, and FSDP2 warns of a unit returning one (an in-place op on it
would skip its pre-backward hook: "a view tensor ... wrong gradients"), which the size rule, picking the first modules
big enough, did on every such model. A model without blocks (or ``comm.fsdp_min_params`` set) gets the size rule:
every module holding that many parameters not yet in a unit (2^20 or an eighth of the model, the fewer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from torch import nn


def choose_units(
    model: nn.Module, unit_classes: tuple[str, ...] = (), min_params: Optional[int] = None
) -> list[tuple[str, nn.Module]]:
    """The modules wrapped as units, children before parents (the root comes last, apart): the classes named, else
    the blocks (``min_params`` unset), else the modules holding ``min_params`` parameters (see the docstring)."""
    blocks = _blocks(model) if not unit_classes and min_params is None else set()
    total = sum(p.numel() for p in model.parameters())
    least = min_params if min_params is not None else max(1, min(1 << 20, total // 8))

    def wanted(module: nn.Module, free: int) -> bool:
        if unit_classes:
            return type(module).__name__ in unit_classes
        return id(module) in blocks if blocks else free >= least

    chosen = _visit(model, wanted)
    if unit_classes and not chosen:
        present = sorted({type(m).__name__ for _, m in model.named_modules() if any(True for _ in m.parameters())})
        raise ValueError(
            f"comm.fsdp_units={list(unit_classes)}: no module of {type(model).__name__} is one (every parameter would "
            f"be gathered at once, with the root); HINT: the classes holding parameters: {', '.join(present)}"
        )
    return chosen


def _visit(model: nn.Module, wanted: Callable[[nn.Module, int], bool]) -> list[tuple[str, nn.Module]]:
    """Every module but the root, children first, that ``wanted(module, free parameters)`` and that may be a unit."""
    shared, claimed, chosen = _shared_outside(model), set[int](), []

    def visit(name: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        if not name or name in shared or not _called(module):
            return  # the root (apart), tied weights, containers never called (ModuleList: no forward to gather in)
        free = [p for p in module.parameters() if id(p) not in claimed]
        if free and wanted(module, sum(p.numel() for p in free)):
            claimed.update(id(p) for p in free)
            chosen.append((name, module))

    visit("", model)
    return chosen


def _called(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _blocks(model: nn.Module) -> set[int]:
    """The blocks (by id): the items of a ``ModuleList`` that are modules of modules with a forward of their own."""
    return {
        id(item)
        for list_ in model.modules()
        if isinstance(list_, nn.ModuleList)
        for item in list_
        if _called(item) and any(True for _ in item.children()) and any(True for _ in item.parameters())
    }


def _shared_outside(model: nn.Module) -> set[str]:
    """Modules (by name) holding a parameter also reachable from outside their subtree (tied weights): never a unit of
    their own (FSDP refuses a parameter in two units)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    shared = set()
    for module_name, module in model.named_modules():
        if not module_name:
            continue
        prefix = module_name + "."
        for p in module.parameters():
            if any(not n.startswith(prefix) for n in names[id(p)]):
                shared.add(module_name)
                break
    return shared
