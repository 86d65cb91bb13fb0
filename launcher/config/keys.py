"""Command-line keys checked against the typed schema before Hydra composes anything: ``+train.epoch=2`` would be
added beside ``train.epochs`` and the job would run its 10 epochs as if nothing was said; ``train.epoch=2`` gets
Hydra's raw ``Key 'epoch' not in 'TrainConfig' (full_key, reference_type ...)``. Either is refused here with the
key, the closest known ones and exit 2. Open places stay open: ``model`` and ``data`` (a user's classes take any
keyword), dict-typed fields (``cluster.env``, ``data.kwargs``, ...), and ``hydra.*``."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Optional

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
