"""The command line before Hydra reads it (``prepared``): every key checked against the schema (``config.keys``),
a run continued with ``hydra.run.dir=DIR`` alone taking DIR's own overrides again (what the stop message prints
works as printed), and a dry run writing nothing (no ``.hydra`` folder in a run dir it would leave behind)."""

from __future__ import annotations

import sys

import yaml

from launcher.base.run_dir import RunDir
from launcher.config.keys import check_keys

# Hydra's flags that take the next argument as their value (the rest of the command line is overrides)
VALUED_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p")
RUN_DIR = "hydra.run.dir="


def hydra_overrides(args: list[str]) -> list[str]:
    """The overrides of a Hydra command line (its flags and their values left out)."""
    out, skip = [], False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = not skip and arg in VALUED_FLAGS
            continue
        out.append(arg)
    return out


def prepared(args: list[str]) -> list[str]:
    """``args`` as Hydra should get them; ConfigError for a key the schema does not have."""
    overrides = hydra_overrides(args)
    if len(overrides) == 1 and overrides[0].startswith(RUN_DIR) and len(args) == 1:
        args = [*args, *continued(overrides[0].removeprefix(RUN_DIR))]
        overrides = hydra_overrides(args)
    check_keys(overrides)
    if any(o.lower() in ("dry_run=true", "dry_run=1", "dry_run=yes") for o in overrides):
        args = [*args, "hydra.output_subdir=null"]
    return args


def continued(run_dir: str) -> list[str]:
    """The overrides ``run_dir``'s run was started with (Hydra's record), but its run dir: a run continued by
    ``hydra.run.dir=DIR`` alone is the same job, not the defaults' (which its checkpoints would refuse)."""
    saved = RunDir(run_dir).overrides
    try:
        previous = yaml.safe_load(saved.read_text()) or []
    except (OSError, yaml.YAMLError):
        return []
    again = [str(o) for o in previous if not str(o).startswith((RUN_DIR, "dry_run="))]
    if again:
        print(f"[launcher] continuing {run_dir} with its own overrides: {' '.join(again)}", file=sys.stderr)
    return again
