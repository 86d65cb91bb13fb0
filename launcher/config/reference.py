"""The configuration reference (docs/configuration-reference.md), generated from the schemas so it cannot go stale:
every key with its type, its default and the sentence its field's comment says (the comment on the field's line and
its aligned continuation lines, or the comment lines right above the field), grouped as the config is; the model
groups' keys come from ``conf/model/*.yaml``. ``tests/rules/test_config_reference.py`` fails when the page differs
from what this prints, when a key lacks its sentence, or when a key of a composed config is missing here.

    python -m launcher.config.reference > docs/configuration-reference.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import typing
from typing import Any

from omegaconf import MISSING, OmegaConf

from launcher.base.sync_modes import Mode
from launcher.config.load import CLUSTER_SCHEMAS, CONF_DIR
from launcher.config.schema import JobConfig

HEADER = """# Configuration reference

Generated from the typed schemas (`launcher/config/schema.py`, `comm.py`, `clusters.py`) and the model
groups (`conf/model/`) by `python -m launcher.config.reference > docs/configuration-reference.md`; a test fails
when this page is stale. Set any key on the command line (`train.epochs=3`); `python -m launcher --cfg job [...]`
prints the composed values and `dry_run=true` the plan. How the keys work together: [Configuration](configuration.md).
"""
SECTIONS = {  # JobConfig's groups of keys, in this order, each with its sentence
    "cluster": "Where the job runs: this machine unless `+cluster=sim|slurm|ssh` chooses another kind.",
    "train": "The built-in trainer: length, batch, checkpoints, precision, what it minimises.",
    "optim": "The optimiser and its learning-rate schedule.",
    "comm": "Gradient synchronisation: the reducer, the hierarchy, buckets, overlap, compression, the watch.",
    "data": "The data set: a built-in one (`data=digits|synthetic|idx`) or your own factory.",
}


def field_comments(cls: Any) -> dict[str, str]:
    """Each field of dataclass ``cls`` (its own class body, not its bases') -> the sentence its comments say."""
    lines, _ = inspect.getsourcelines(cls)
    body = ast.parse(textwrap.dedent("".join(lines))).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    for node in body.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        start, end = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        indent = len(lines[start]) - len(lines[start].lstrip())
        said = [_comment(lines[i]) for i in range(start, end + 1)]
        below = end + 1
        while below < len(lines) and _continues(lines[below], indent):  # aligned continuation lines
            said.append(_comment(lines[below]))
            below += 1
        above: list[str] = []
        i = start - 1
        while i >= 0 and lines[i].strip().startswith("#") and not _continues(lines[i], indent):
            above.insert(0, _comment(lines[i]))
            i -= 1
        out[node.target.id] = " ".join(s for s in above + said if s)
    return out


def _comment(line: str) -> str:
    """The text of a line's comment ('' when none; a ``#`` inside a string does not count)."""
    if line.lstrip().startswith("#"):
        return " ".join(line.split("#", 1)[1].split())
    _, hash_, text = line.partition("  #")
    return " ".join(text.split()) if hash_ else ""


def _continues(line: str, indent: int) -> bool:
    """A comment-only line aligned under the previous field's comment (its text starts right of ``# ``)."""
    stripped = line.lstrip()
    if not stripped.startswith("#"):
        return False
    after = stripped[1:]
    return len(after) - len(after.lstrip()) > 1 and len(line) - len(stripped) == indent


def _type(annotation: Any, resolved: Any = None) -> str:
    """The type column: the annotation as written (``Optional[X]``: ``X or null``); a choice's members."""
    if isinstance(resolved, type) and issubclass(resolved, Mode):
        return "one of " + ", ".join(member.value for member in resolved)
    text = str(annotation).replace("typing.", "")
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional[") : -1] + " or null"
    return text


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is MISSING:
        return "(a group)"
    if isinstance(value, (list, dict)):
        return json.dumps(value)  # one line, as on the command line
    return OmegaConf.to_yaml({"v": value}).strip()[3:].strip() or "''"


def rows(cls: Any, prefix: str, only: set[str] | None = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, sentence) of each field of ``cls`` (those in ``only`` when given), comments looked up
    in the class that defines or overrides the field."""
    said: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            said.update({k: v for k, v in field_comments(klass).items() if v or k not in said})
    hints = typing.get_type_hints(cls)
    return [
        (f"{prefix}{f.name}", _type(f.type, hints.get(f.name)), _default(f), said.get(f.name, ""))
        for f in dataclasses.fields(cls)
        if only is None or f.name in only
    ]


def model_groups() -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """Each ``model=`` group file: (name, its first comment line, the rows of its keys)."""
    out = []
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        text = path.read_text()
        about = next((line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), "")
        rows_ = []
        group: dict[str, Any] = OmegaConf.to_container(OmegaConf.create(text), resolve=False)  # type: ignore[assignment]
        for key, value in group.items():
            follows = isinstance(value, str) and value.startswith("${")
            what = "the class or factory" if key == "_target_" else f"passed as `{key}=`"
            kind = "interpolation" if follows else type(value).__name__
            rows_.append((f"model.{key}", kind, str(value), what + (f", following `{value[2:-1]}`" if follows else "")))
        out.append((path.stem, about, rows_))
    return out


def _table(rows_: list[tuple[str, str, str, str]]) -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, kind, default, said in rows_:
        lines.append(f"| `{key}` | {_text(kind)} | `{default}` | {_text(said)} |")
    return "\n".join(lines)


def _text(said: str) -> str:
    """A comment as table text: nothing in it read as HTML (``<subnet>``), emphasis (``_target_``) or a cell end."""
    for raw, shown in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "&#124;"), ("_", "\\_"), ("*", "\\*")):
        said = said.replace(raw, shown)
    return said


def render() -> str:
    parts = [HEADER]
    top = {f.name for f in dataclasses.fields(JobConfig)} - set(SECTIONS) - {"model"}
    parts.append("## Top level\n\n" + _table(rows(JobConfig, "", top)))
    groups: dict[str, Any] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # their classes
    for name, about in SECTIONS.items():
        cls = groups[name]
        parts.append(f"## `{name}`\n\n{about}\n\n" + _table(rows(cls, f"{name}.")))
        if name == "cluster":
            base = {f.name: _default(f) for f in dataclasses.fields(cls)}
            for kind, sub in CLUSTER_SCHEMAS.items():
                if sub is cls:
                    continue
                changed = {f.name for f in dataclasses.fields(sub) if base.get(f.name) != _default(f)}
                parts.append(
                    f"### `+cluster={kind}`\n\n{inspect.getdoc(sub)}\n\nIts own keys, and the defaults it changes "
                    "(every other `cluster.*` key above applies too):\n\n" + _table(rows(sub, "cluster.", changed))
                )
    parts.append(
        "## `model`\n\nA group (`model=lenet`, the default, `mlp`, `resnet18` or `text_classifier`: `conf/model/`), "
        "or any `nn.Module` class or factory: `model._target_=pkg.module.Class` with its arguments as "
        "`+model.NAME=VALUE` (the group's keys are then dropped)."
    )
    for name, about, rows_ in model_groups():
        parts.append(f"### `model={name}`\n\n{about}\n\n" + _table(rows_))
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
