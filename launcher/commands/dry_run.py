"""``python -m launcher ... dry_run=true``: the resolved config and the launch plan printed, and what the job builds
from its dotted paths built here, so that an error in the user's class, factory or arguments shows before anything
starts: the model (``model._target_``, and what it nests), the user's data (``data._target_(**data.kwargs)``, checked
as a rank checks it) and, at planning already, each metric of ``train.metrics`` (``launch/plan.py``). An error names
its key, what it raised and the fix (exit 2). Nothing is started and nothing is left: the run dir Hydra made for it
goes again, empty."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any, cast

from hydra.utils import get_method, get_object, instantiate

from launcher.config import ConfigError, JobConfig, to_yaml
from launcher.config.targets import Target, build_error
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.train.data import IMAGE_MODELS, checked_datasets

EXIT_OK, EXIT_CONFIG = 0, 2


def dry_run(job: JobConfig, plan: LaunchPlan, mode: BaseMode) -> int:
    """Print what ``job`` would run and build what it builds; its exit code (2: something cannot be built)."""
    try:
        lines = built_here(job)
    except ConfigError as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        code = EXIT_CONFIG
    else:
        print(to_yaml(job) + "\n# launch plan\n" + plan.describe())
        print("\n".join(lines))
        if extra := mode.preview(job):
            print("\n" + extra)
        code = EXIT_OK
    with contextlib.suppress(OSError):  # the run dir Hydra made for it, empty: a dry run leaves nothing
        Path(job.run_dir).rmdir()
    return code


def built_here(job: JobConfig) -> list[str]:
    """The model and the user's data built as a rank builds them (the trainer's job), a line each."""
    if job.script is not None or job.doctor:
        return []
    model = job.model
    target = Target("model._target_", str(model["_target_"]), at="model")
    made = built_or_said(target, {k: v for k, v in model.items() if not k.startswith("_")}, lambda: instantiate(model))
    parameters = sum(p.numel() for p in made.parameters()) if hasattr(made, "parameters") else 0
    lines = [f"model       : {type(made).__name__}, {parameters:,} parameters"]
    data = job.data
    if data._target_ is not None:
        target = Target("data._target_", data._target_, at="data.kwargs")
        returned = built_or_said(target, data.kwargs, lambda: get_method(target.path)(**data.kwargs))
        try:  # checked as a rank checks it: two map-style splits, a built-in model's images as the config says
            train, test = checked_datasets(data, returned, images=model["_target_"] in IMAGE_MODELS)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        held_out = f"{len(cast(Sized, test)):,} held-out" if test is not None else "no held-out split"
        lines.append(f"data        : {data._target_}: {len(cast(Sized, train)):,} training samples, {held_out}")
    return lines


def built_or_said(target: Target, given: dict[str, Any], make: Callable[[], Any]) -> Any:
    """``make()``, the user's code: whatever it raises becomes a ConfigError naming ``target`` and the fix."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - the user's code: whatever it raises is reported
        try:
            made = get_object(target.path)
        except Exception:  # noqa: BLE001 - (resolved with the config already; the signature only helps the hint)
            made = None
        raise ConfigError(build_error(target, made, list(given), exc)) from exc
