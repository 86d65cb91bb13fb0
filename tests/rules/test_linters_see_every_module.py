"""ruff and mypy each see every module of launcher/ (issue 57: ruff's default excludes hold ``dist``, so
``ruff check .`` linted 132 of launcher/'s 138 modules, said "All checks passed!" and hid an import-order error in
launcher/dist/helpers.py). Asked of the tools themselves, with this checkout's pyproject.toml: the files
``ruff check --show-files`` lists, no folder or module named like one of ruff's excludes (``dist``, ``build``,
``_build``, ``venv``, ``node_modules``, ... as ``ruff check --show-settings`` prints them: a new folder of that name
would be skipped silently), and the sources mypy builds from its ``files`` (mypy skips ``site-packages``,
``node_modules`` and dot-folders, and its ``exclude``). The third reader, docs/layout.md, names every module:
tests/rules/test_house.py checks that. Each check is also run on a small tree with a folder the tool skips."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from fnmatch import fnmatch
from pathlib import Path

from mypy.config_parser import parse_config_file
from mypy.find_sources import create_source_list
from mypy.options import Options

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "launcher"


def _ruff(root: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *args], cwd=root, capture_output=True, text=True, timeout=60
    )
    return done.stdout


def modules(root: Path) -> set[str]:
    """Every module of the package under ``root``, as ``launcher/...py``."""
    return {str(path.relative_to(root)) for path in (root / PACKAGE).rglob("*.py")}


def unseen_by_ruff(root: Path) -> list[str]:
    """The package's modules ``ruff check`` (run in ``root``, with its config) does not list."""
    listed = {str(Path(line).relative_to(root)) for line in _ruff(root, "--show-files").splitlines() if line}
    return sorted(modules(root) - listed)


def ruff_excludes(root: Path) -> list[str]:
    """ruff's exclude patterns in ``root`` (its defaults, then the config's ``extend-exclude``)."""
    settings = _ruff(root, "--show-settings", f"{PACKAGE}/__init__.py")
    found = []
    for key in ("exclude", "extend_exclude"):
        block = re.search(rf"^file_resolver\.{key} = \[\n(.*?)^\]", settings, flags=re.MULTILINE | re.DOTALL)
        assert block, f"ruff --show-settings printed no file_resolver.{key}: its format changed"
        found += re.findall(r'^\s*"(.*)",$', block.group(1), flags=re.MULTILINE)
    return found


def names_ruff_excludes(root: Path) -> list[str]:
    """The package's folders and modules whose name (or path) matches one of ruff's exclude patterns."""
    excludes = ruff_excludes(root)
    paths = {Path(module) for module in modules(root)}
    names = {part for path in paths for part in path.parts} | {str(p) for path in paths for p in path.parents}
    return sorted(name for name in names for pattern in excludes if fnmatch(name, pattern))


def unseen_by_mypy(root: Path) -> list[str]:
    """The package's modules mypy does not build from its config's ``files`` (and ``exclude``) in ``root``."""
    options = Options()
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        parse_config_file(options, lambda: None, str(root / "pyproject.toml"))
    options.files = [str(root / f) for f in options.files or []]
    built = {str(Path(source.path).relative_to(root)) for source in create_source_list(options.files, options)}
    return sorted(modules(root) - built)


def test_ruff_lints_every_module():
    assert not unseen_by_ruff(REPO), f"ruff check skips these modules of launcher/: {unseen_by_ruff(REPO)}"


def test_no_folder_or_module_is_named_like_one_ruff_excludes():
    assert "dist" in ruff_excludes(REPO)  # (its defaults are read: the name issue 57 found)
    hidden = names_ruff_excludes(REPO)
    assert not hidden, f"launcher/ has folders or modules named like ruff's excludes (rename them): {hidden}"


def test_mypy_checks_every_module():
    assert not unseen_by_mypy(REPO), f"mypy's files skip these modules of launcher/: {unseen_by_mypy(REPO)}"


def _tree(root: Path, pyproject: str, *folders: str) -> Path:
    """A package with a module in each of ``folders``, and ``pyproject``."""
    (root / "pyproject.toml").write_text(pyproject)
    for folder in ("", *folders):
        (root / PACKAGE / folder).mkdir(parents=True, exist_ok=True)
        (root / PACKAGE / folder / "__init__.py").write_text("")
        (root / PACKAGE / folder / "helpers.py").write_text("X = 1\n")
    return root


def test_a_folder_ruff_skips_is_caught(tmp_path):
    ruff = re.search(r"^\[tool\.ruff\]\n.*?(?=^\[(?!tool\.ruff))", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert ruff, "pyproject.toml has no [tool.ruff]"
    root = _tree(tmp_path, ruff.group(0), "group", "dist")
    assert unseen_by_ruff(root) == ["launcher/dist/__init__.py", "launcher/dist/helpers.py"]
    assert names_ruff_excludes(root) == ["dist"]


def test_a_folder_mypy_skips_is_caught(tmp_path):
    root = _tree(tmp_path, '[tool.mypy]\nfiles = ["launcher"]\nexclude = ["launcher/old/"]\n', "group", "old", ".hide")
    assert unseen_by_mypy(root) == [
        f"launcher/{f}/{m}" for f in (".hide", "old") for m in ("__init__.py", "helpers.py")
    ]
    (root / "pyproject.toml").write_text('[tool.mypy]\nfiles = ["models"]\n')
    assert "launcher/helpers.py" in unseen_by_mypy(root)
