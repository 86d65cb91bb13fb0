"""One name per idea in launcher/ (issue 57), read from the code with ``ast``, no import of it:

- No public (not ``_``-prefixed) top-level class or function name is defined in two modules: ``Healing`` was the
  trainer's seam and the head's keeper state, ``Lost`` a round's end and the head's word to the keeper, ``NodeArgs``
  a dataclass and a Protocol mirroring it. What must share a name is in ``SHARED``, each with why.
- Every module or module attribute a docstring or a comment cites in backticks (``heal/rounds.py``,
  ``launcher.train.stop``, ``report.stops.print_stopped``, ``waiting.wait_for_nodes``) exists: docstrings cited
  heal/keeper.py's ``head.KeeperClient`` and ``protocol.BEAT_S`` long after both had moved.

What counts as a citation (pragmatic; names of torch, the config's keys' own dataclasses aside): a backticked path
ending in ``.py`` whose first folder is one of launcher/'s (or ``launcher/``), or a bare ``name.py``; a backticked
dotted name whose first part is ``launcher``, a folder or a module of launcher/ (``rank.work``, ``waiting.Rejoin``).
A path resolves when a module of launcher/ ends with it; a dotted name when it walks from a module of that name
through submodules, then top-level names (defined or imported), then a class's attributes. A dotted name whose
first part is a section of the config (``train.loss``, ``comm.timeout_s``) may instead name a field of the config's
dataclasses (launcher/config/)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "launcher"
MODULES = sorted(PACKAGE.rglob("*.py"))

# A public name several modules define on purpose, and why.
SHARED = {
    # ``python -m launcher...``'s entry function in each module run that way (the keeper, a node process, a rank,
    # rank 0's console tee, the Hydra entry and its torch-free --help): the name ``python -m`` readers look for
    "main",
}


def _public_definitions(path: Path) -> list[tuple[str, int]]:
    """(name, line) of each public top-level class and function of a module."""
    tree = ast.parse(path.read_text())
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [(node.name, node.lineno) for node in tree.body if isinstance(node, kinds) and not node.name.startswith("_")]


def twins(paths: list[Path], root: Path) -> dict[str, list[str]]:
    """Each public top-level name defined in more than one of ``paths``: the modules (``path:line``) defining it."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        for name, line in _public_definitions(path):
            where[name].append(f"{path.relative_to(root)}:{line}")
    return {name: places for name, places in sorted(where.items()) if len(places) > 1}


def test_no_public_name_is_defined_in_two_modules():
    found = {name: places for name, places in twins(MODULES, PACKAGE.parent).items() if name not in SHARED}
    assert not found, (
        f"public names defined in several modules of launcher/ (one name per idea: rename one, or merge them; a "
        f"protocol and its one implementation may share one, listed in SHARED with why): {found}"
    )


def test_the_allow_list_holds_only_names_still_shared():
    """An entry of SHARED whose twins are gone goes too (it would hide the next twin of that name)."""
    stale = sorted(SHARED - set(twins(MODULES, PACKAGE.parent)))
    assert not stale, f"SHARED names no longer defined in several modules: {stale}"


def test_a_twin_is_caught(tmp_path):
    for folder in ("heal", "train"):
        (tmp_path / folder).mkdir()
    (tmp_path / "heal" / "protocol.py").write_text("class Lost:\n    pass\n\n\ndef _own():\n    pass\n")
    (tmp_path / "train" / "progress.py").write_text(
        "from x import y\n\n\nclass Lost:\n    pass\n\n\ndef _own():\n    pass\n"
    )
    assert twins(sorted(tmp_path.rglob("*.py")), tmp_path) == {"Lost": ["heal/protocol.py:1", "train/progress.py:4"]}


# ---------------------------------------------------------------------------------------------------- citations
@dataclass
class Module:
    """What a module defines at its top level (its classes with their attributes), and what it imports by name."""

    names: set[str] = field(default_factory=set)
    classes: dict[str, set[str]] = field(default_factory=dict)
    imported: dict[str, str] = field(default_factory=dict)  # a name -> the dotted name it was imported as


def _targets(node: ast.AST) -> list[str]:
    """The names an assignment binds (``a = ``, ``a: int = ``, ``a, b = ``)."""
    found = [node] if isinstance(node, ast.Name) else list(node.elts) if isinstance(node, ast.Tuple) else []
    return [n.id for n in found if isinstance(n, ast.Name)]


def _class_attributes(cls: ast.ClassDef) -> set[str]:
    """A class's attributes: its body's methods, fields and nested classes, and every ``self.x`` its methods set."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(name for target in node.targets for name in _targets(target))
        elif isinstance(node, ast.AnnAssign):
            names.update(_targets(node.target))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    return names


def _read_module(path: Path) -> Module:
    module = Module()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            module.names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            module.names.add(node.name)
            module.classes[node.name] = _class_attributes(node)
        elif isinstance(node, ast.Assign):
            module.names.update(name for target in node.targets for name in _targets(target))
        elif isinstance(node, ast.AnnAssign):
            module.names.update(_targets(node.target))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:  # (launcher/ imports absolutely: ruff's isort)
                module.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module.imported[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, (ast.If, ast.Try)):  # names bound under a guard (``try: import x``) count as names
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    module.names.update((a.asname or a.name).split(".")[0] for a in inner.names)
                elif isinstance(inner, (ast.FunctionDef, ast.ClassDef)):
                    module.names.add(inner.name)
                elif isinstance(inner, ast.Assign):
                    module.names.update(name for target in inner.targets for name in _targets(target))
    return module


@dataclass
class Package:
    """A package's modules by dotted name (``launcher.heal.protocol``), and the config's field names by section."""

    root: Path  # the folder holding the package (the repository)
    modules: dict[str, Module]
    paths: list[str]  # every module's path from the root: ``launcher/heal/protocol.py``
    sections: set[str]  # the config's top-level keys: ``train``, ``comm``, ``cluster``, ...
    fields: set[str]  # every field of the config's dataclasses

    @classmethod
    def read(cls, package: Path) -> Package:
        modules: dict[str, Module] = {}
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[dotted] = _read_module(path)
        schema = modules.get(f"{package.name}.config.schema", Module())
        configs = [m for name, m in modules.items() if name.startswith(f"{package.name}.config.")]
        fields = {attr for m in configs for attrs in m.classes.values() for attr in attrs}
        paths = [str(p.relative_to(package.parent)) for p in sorted(package.rglob("*.py"))]
        return cls(package.parent, modules, paths, schema.classes.get("JobConfig", set()), fields)

    def starts(self, first: str) -> list[str]:
        """The modules (or packages) a citation's first part names: the package itself, or any of that name."""
        return [name for name in self.modules if name == first or name.endswith(f".{first}")]

    def cited(self, text: str) -> bool:
        """Whether a dotted name or a path is a citation of launcher/ (see the module's docstring)."""
        if text.endswith(".py"):
            parts = text.split("/")
            folders = {Path(p).parent.name for p in self.paths} | {self.paths[0].split("/")[0]}
            return len(parts) == 1 or parts[0] in folders
        return bool(self.starts(text.split(".")[0]))

    def resolves(self, text: str) -> bool:
        if text.endswith(".py"):
            return any(path == text or path.endswith(f"/{text}") for path in self.paths)
        first, *rest = text.split(".")
        if first in self.sections and rest and (rest[0] in self.fields or rest[0].startswith("_")):
            return True  # a config key (``comm.timeout_s``, ``model._target_``)
        return any(self._walk(start, rest) for start in self.starts(first))

    def _walk(self, module: str, rest: list[str], depth: int = 0) -> bool:
        for index, part in enumerate(rest):
            if f"{module}.{part}" in self.modules:
                module = f"{module}.{part}"
                continue
            found = self.modules[module]
            if part in found.classes:
                return index + 1 == len(rest) or rest[index + 1] in found.classes[part]
            if part in found.names:
                return True
            if any(part in attributes for attributes in found.classes.values()):
                return True  # a value of the module's type: ``env.rank`` (a DistEnv's), ``reducer.step``
            if part in found.imported:  # a re-export: followed when it is the package's own, else trusted
                target = found.imported[part]
                owner, _, name = target.rpartition(".")
                if target in self.modules:
                    module = target
                    continue
                if owner in self.modules and depth < 3:
                    return self._walk(owner, [name, *rest[index + 1 :]], depth + 1)
                return True
            return False
        return True


SPAN = re.compile(r"``(.+?)``|(?<!`)`([^`\n]+)`(?!`)")
# a path ending in .py, or a dotted name; not one given a value (``train.epochs=2``: a key on a command line)
TOKEN = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/=-])")
# a file of a run dir or a checkpoint, not a module: ``metrics.jsonl``, ``train.pt``, ``config.yaml``
FILE_SUFFIXES = {"json", "jsonl", "pt", "yaml", "yml", "log", "png", "txt", "toml", "md", "safetensors", "csv", "sh"}
# Backticked dotted names that look like a citation and are none, with what they are.
NOT_CITATIONS = {
    "work.wait",  # comm/collectives.py: a torch ``Work``'s method
    "mesh.get_group",  # group/mesh.py: a ``DeviceMesh``'s method
}


def _texts(source: str) -> list[tuple[int, str, set[str]]]:
    """(line, text, the parameters it may name) of every docstring and comment of a module's source: a function's
    docstring names its own parameters (``env.rank``: the ``env`` it is given), which are no citations."""
    found: list[tuple[int, str, set[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    args = node.args if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
                    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} if args else set()
                    found.append((first.lineno, first.value.value, names))
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    found += [(token.start[0], token.string, set()) for token in tokens if token.type == tokenize.COMMENT]
    return found


def citations(source: str, package: Package) -> list[tuple[int, str]]:
    """(line, citation) of everything a module's docstrings and comments cite of launcher/ in backticks."""
    found = []
    for line, text, parameters in _texts(source):
        for span in SPAN.finditer(text):
            inside = span.group(1) or span.group(2)
            for token in TOKEN.finditer(inside):
                cited = token.group(1)
                if cited.rpartition(".")[2] in FILE_SUFFIXES or cited in NOT_CITATIONS:
                    continue
                if cited.split(".")[0] in parameters or (
                    "/" not in cited and cited.endswith(".py") and cited != inside
                ):
                    continue  # a parameter's attribute; a bare ``name.py`` amid words: a script (``train.py --lr``)
                if package.cited(cited):
                    found.append((line + text[: span.start()].count("\n"), cited))
    return found


def missing_citations(path: Path, package: Package) -> list[str]:
    return [
        f"line {line}: {cited}" for line, cited in citations(path.read_text(), package) if not package.resolves(cited)
    ]


PACKAGE_READ = Package.read(PACKAGE)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_module_a_docstring_cites_exists(path):
    missing = missing_citations(path, PACKAGE_READ)
    assert not missing, (
        f"{path.relative_to(PACKAGE.parent)} cites modules or names that do not exist (renamed or moved: cite the "
        f"new place): {missing}"
    )


SAMPLE = '''"""Reads ``heal/keeper.py`` and ``launch/nodes/waiting.py``; ``protocol.Decision``,
``launcher.heal.rounds``, ``Membership.apply`` (not a module: not checked), ``torch.distributed`` (not ours),
``train.loss`` (a config key), ``env.rank`` (a DistEnv's), ``train.py --lr 0.1`` (a script), ``train.pt``."""

# a citation in a comment: `nodes.control.Control.ABORT`, ``config.rules.heals_in_place(job)``
'''


@pytest.mark.parametrize(
    "stale",
    [
        "``heal/gone.py``",
        "``launch/gone/waiting.py``",
        "``protocol.BEAT_S``",
        "``head_side.Gone``",
        "``launcher.heal.gone``",
        "``control.Control.NOPE``",
        "``train.no_such_key``",
    ],
)
def test_a_stale_citation_is_caught(stale, tmp_path):
    assert missing_citations(_sample(tmp_path, SAMPLE), PACKAGE_READ) == []
    assert missing_citations(_sample(tmp_path, f'"""Once {stale}, now gone."""\n'), PACKAGE_READ) == [
        f"line 1: {stale.strip('`')}"
    ]


def _sample(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "sample.py"
    path.write_text(source)
    return path
