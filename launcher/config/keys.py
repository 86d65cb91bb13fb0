"""Command-line keys checked against the typed schema before Hydra composes anything: ``+train.epoch=2`` would be
added beside ``train.epochs`` and the job would run its 10 epochs as if nothing was said; ``train.epoch=2`` gets
Hydra's raw ``Key 'epoch' not in 'TrainConfig' (full_key, reference_type ...)``. Either is refused here with the
key, the closest known ones and exit 2. Open places stay open: ``model`` and ``data`` (a user's classes take any
keyword), dict-typed fields (``cluster.env``, ``data.kwargs``, ...), and ``hydra.*``. The values of the choices
(Enum fields: ``comm.compress``, ``comm.hierarchical``, ...) are checked too, and true or false put as their
members' names (``choice_overrides``)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Optional

from launcher.base.sync_modes import Mode
from launcher.config.errors import not_a_choice
from launcher.config.load import CLUSTER_SCHEMAS
from launcher.config.schema import ConfigError, JobConfig

OPEN_GROUPS = ("model", "data", "hydra")
GROUPS = ("model", "data", "cluster")  # config groups: ``model=resnet18``, ``+cluster=slurm`` choose a file


def _fields(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(schema)}


def check_keys(overrides: list[str]) -> None:
    """Raise ConfigError naming the first override whose key the schema does not have (with "did you mean")."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a malformed override: Hydra says what is wrong with it, as it always did
        return
    kind = next((str(o.value()) for o in parsed if o.key_or_group == "cluster" and not o.is_delete()), "local")
    for override in parsed:
        key = override.key_or_group
        if "/" in key or key.split(".")[0] in OPEN_GROUPS or key in GROUPS or override.package is not None:
            continue
        problem = unknown(key, CLUSTER_SCHEMAS.get(kind, CLUSTER_SCHEMAS["local"]))
        if problem:
            raise ConfigError(f"{override.input_line}: {problem}; HINT: every key is in launcher/config/schema.py")


def unknown(key: str, cluster_schema: type) -> Optional[str]:
    """Why ``key`` (dotted) is not in the job's schema, or None (known, or under an open place)."""
    schema: Any = JobConfig
    walked: list[str] = []
    for part in key.split("."):
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            return None  # under a dict, a list or Any: open
        fields = _fields(schema)
        if part not in fields:
            where = ".".join(walked) or "the job"
            close = difflib.get_close_matches(part, list(fields), n=3, cutoff=0.6)
            known = [".".join([*walked, c]) for c in close]
            hint = f"did you mean {' or '.join(known)}?" if known else f"{where} has: {', '.join(sorted(fields))}"
            return f"{'.'.join([*walked, part])} is not a key of {where} ({hint})"
        walked.append(part)
        schema = cluster_schema if walked == ["cluster"] else fields[part]
    return None


def choice_overrides(args: list[str]) -> list[str]:
    """``args`` (a command line: flags pass as they are) with every choice's value checked before Hydra composes: one
    that is no member is a ConfigError naming it and the members. Hydra's grammar reads true and false as bools, which
    an Enum field refuses: they become the member's name, quoted (``comm.hierarchical=true`` ->
    ``comm.hierarchical='true'``; sweeps too), so the command lines of a str field work as they did."""
    return [_choice_override(arg) for arg in args]


def _choice_override(arg: str) -> str:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, Override, QuotedString, Sweep

    kind = None if arg.startswith("-") or "=" not in arg else _choice(arg.split("=", 1)[0].lstrip("+~"))
    if kind is None:
        return arg
    try:
        override = OverridesParser.create().parse_overrides([arg])[0]
    except Exception:  # noqa: BLE001 - a malformed override: Hydra says what is wrong with it
        return arg
    value = None if override.is_delete() else override.value()
    sweep = value if isinstance(value, ChoiceSweep) else None
    if override.is_delete() or (sweep is None and isinstance(value, (list, dict, Sweep))):
        return arg  # (Hydra refuses a range or a list for a choice itself)
    elements: list[Any] = sweep.list if sweep is not None else [value]
    for element in elements:
        text = element.text if isinstance(element, QuotedString) else element
        if kind.of(text) is None and not (isinstance(text, str) and "${" in text):  # (an interpolation: resolved later)
            raise ConfigError(not_a_choice(override.key_or_group, text, kind))
    if not any(isinstance(element, bool) for element in elements):
        return arg
    named = [f"'{kind.of(e)}'" if isinstance(e, bool) else Override._get_value_element_as_str(e) for e in elements]
    joined = ",".join(named)
    return f"{override.get_key_element()}={joined if sweep is None or sweep.simple_form else f'choice({joined})'}"


def _choice(key: str) -> Optional[type[Mode]]:
    """The Enum of the schema's field at ``key`` (dotted), or None (no such field, or not a choice)."""
    schema: Any = JobConfig
    for part in key.split("."):
        if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
            return None
        schema = _fields(schema).get(part)
    return schema if isinstance(schema, type) and issubclass(schema, Mode) else None


def own_model(model: Any, overrides: list[str]) -> None:
    """``model._target_=pkg.Cls`` on the command line without ``model=<group>``: the default group's keys (LeNet's
    ``in_channels``, ``num_classes``, ``image_size``) are not the user's class's: only ``_target_`` and the model
    keys the command line gives stay (in place, on the composed config)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    if any(o.key_or_group == "model" for o in parsed) or not any(o.key_or_group == "model._target_" for o in parsed):
        return
    given = {o.key_or_group.split(".")[1] for o in parsed if o.key_or_group.startswith("model.") and not o.is_delete()}
    for key in [k for k in model if k not in given]:
        del model[key]


def check_model_keys(model: dict) -> None:
    """Before anything starts: the keys given to ``model._target_`` are parameters it takes, or the error names
    the ones it does not take and how to drop them."""
    import importlib
    import inspect

    module, _, attr = str(model["_target_"]).rpartition(".")
    target = getattr(importlib.import_module(module), attr)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it will say so itself
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    extra = sorted(k for k in model if not k.startswith("_") and k not in params)
    if extra:
        takes = ", ".join(n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL) or "nothing"
        drop = " ".join(f"~model.{k}" for k in extra)
        raise ConfigError(
            f"model._target_={model['_target_']} does not take {', '.join(extra)} (it takes: {takes}); HINT: drop "
            f"them ({drop}), or choose a model group that fits: model=lenet|mlp|resnet18"
        )
