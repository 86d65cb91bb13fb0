"""The command line before Hydra reads it (``prepared``): every key checked against the schema (``config.keys``),
a run continued with ``hydra.run.dir=DIR`` alone taking DIR's own overrides again (what the stop message prints
works as printed), a dry run writing nothing (no ``.hydra`` folder in a run dir it would leave behind), and a
script's arguments after ``--`` handed on verbatim, as torchrun takes them (``script=train.py -- config/x.py
--lr=3e-4``: they become one ``script_args`` override, each quoted for Hydra and OmegaConf)."""

from __future__ import annotations

import re
import sys

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from launcher.base.run_dir import RunDir
from launcher.config import ConfigError
from launcher.config.keys import check_keys
from launcher.config.load import literal

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
    args = script_tail(args)
    overrides = hydra_overrides(args)
    if len(overrides) == 1 and overrides[0].startswith(RUN_DIR) and len(args) == 1:
        args = [*args, *continued(overrides[0].removeprefix(RUN_DIR))]
        overrides = hydra_overrides(args)
    check_keys(overrides)
    if any(o.lower() in ("dry_run=true", "dry_run=1", "dry_run=yes") for o in overrides):
        args = [*args, "hydra.output_subdir=null"]
    return args


def script_tail(args: list[str]) -> list[str]:
    """Everything after the first ``--`` is the script's own command line, verbatim: one ``script_args`` override
    in its place. A ``script_args=`` override Hydra cannot parse names the fix."""
    if "--" in args:
        cut = args.index("--")
        args, tail = args[:cut], args[cut + 1 :]
        if any(o.startswith(("script_args=", "+script_args=")) for o in hydra_overrides(args)):
            raise ConfigError("the script's arguments given twice (script_args= and after --); HINT: keep one")
        args = [*args, "script_args=[" + ",".join(_quoted(arg) for arg in tail) + "]"]
    for override in hydra_overrides(args):
        if override.startswith(("script_args=", "+script_args=")):
            try:
                OverridesParser.create().parse_overrides([override])
            except OverrideParseException:
                raise ConfigError(
                    f"{override!r} is not a list Hydra can read; HINT: give the script's arguments after --, as "
                    "torchrun takes them (python -m launcher script=train.py -- config/x.py --lr=3e-4), or quote "
                    'each element: \'script_args=["config/x.py","--lr=3e-4"]\''
                ) from None
    return args


def _quoted(arg: str) -> str:
    """``arg`` as one element of a Hydra list that OmegaConf gives back verbatim: ``${`` not interpolated, quotes
    and backslashes as typed."""
    arg = literal(arg)  # OmegaConf: a literal ${
    arg = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ('\\"' if m.group(2) else ""), arg)  # Hydra's "..."
    return f'"{arg}"'


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
