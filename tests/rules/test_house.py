"""The house rules that keep launcher/ readable, read from the code: no module over 300 lines, no function over
80 (a longer one is split by concern, as comm/reducer.py was); no path under a run dir built outside
launcher/base/run_dir.py; every heartbeat, poll and timeout named in launcher/base/liveness.py; a Trainer of declared
components, no mixins; docs/layout.md names every module. And the tests' own: every test module in one of
the four tier folders, none importing another (what they share is in tests/harness/ or a conftest.py)."""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "launcher"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 80
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_modules_and_their_functions_are_small():
    """One test for the rule, naming every offender (not one test per module: issue 60, item 3)."""
    over, long = [], []
    for path in MODULES:
        source, where = path.read_text(), path.relative_to(PACKAGE.parent)
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            over.append(f"{where}: {lines} lines")
        long += [
            f"{where}: {node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        ]
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


# --------------------------------------------------------------------------------------------- the run dir's names
# Every path under a run dir is named in launcher/base/run_dir.py (RunDir) and nowhere else. The names are read from
# run_dir.py itself: each string joined with ``/`` there (``"checkpoints"``, ``"metrics.jsonl"``, ``".hydra"``, ...)
# and the literal start of each f-string joined there (``rank-`` of ``f"rank-{rank}.log"``, ``attempt-``, ...).
# Elsewhere such a string may appear in messages, docstrings and logger names, but not where a path is built: an
# operand of ``/``, an argument of ``Path(...)``, ``.joinpath(...)``, ``os.path.join(...)``, or a glob pattern; nor
# may a run-dir file's name be kept in a constant of its own (``FILE_NAME = "summary.json"``, joined later).
RUN_DIR_MODULE = PACKAGE / "base" / "run_dir.py"
PATH_CALLS = ("Path", "PurePath", "PosixPath", "joinpath")
GLOB_CALLS = ("glob", "rglob")


def _texts(node: ast.AST) -> list[str]:
    """The literal text of a string or an f-string (its constant parts), else nothing."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return []


def _path_operands(tree: ast.AST) -> list[ast.AST]:
    """Every expression a path is built from: operands of ``/``, arguments of the path calls, glob patterns."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            found += [node.left, node.right]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            os_path_join = name == "join" and isinstance(func, ast.Attribute) and ast.unparse(func.value) == "os.path"
            if name in PATH_CALLS or os_path_join:
                found += node.args
            elif name in GLOB_CALLS and node.args:
                found.append(node.args[0])
    return found


def _kept_file_names(tree: ast.AST, names: frozenset[str]) -> list[ast.AST]:
    """Strings assigned to a name whose whole text is one of the run dir's file names (with a dot: not a word)."""
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and isinstance(node.value, ast.Constant)
        and node.value.value in names
        and "." in node.value.value
    ]


def _run_dir_names() -> tuple[frozenset[str], tuple[str, ...]]:
    """(the names RunDir joins, the literal starts of the f-strings it joins)."""
    names, prefixes = set(), set()
    for node in _path_operands(ast.parse(RUN_DIR_MODULE.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(part for part in node.value.split("/") if part and "*" not in part)
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefixes.add(str(node.values[0].value))
    return frozenset(names), tuple(sorted(prefixes))


RUN_DIR_NAMES, RUN_DIR_PREFIXES = _run_dir_names()


def test_run_dir_names_are_read_from_run_dir_py():
    expected = {"checkpoints", "metrics.jsonl", "summary.json", "membership.jsonl", "trace.json", "doctor.json"}
    expected |= {"requeues.json", "plots", "hangs", "failures", "watch", "logs", "config.yaml", ".hydra"}
    assert expected <= RUN_DIR_NAMES, sorted(expected - RUN_DIR_NAMES)
    assert {"rank-", "attempt-", "node-", ".ssh-check-"} <= set(RUN_DIR_PREFIXES), RUN_DIR_PREFIXES


def test_only_run_dir_py_builds_run_dir_paths():
    built = []
    for path in MODULES:
        if path == RUN_DIR_MODULE:
            continue
        tree, where = ast.parse(path.read_text()), path.relative_to(PACKAGE.parent)
        built += [
            f"{where} line {node.lineno}: {ast.unparse(node)}"
            for node in _path_operands(tree)
            for text in _texts(node)
            for part in text.split("/")
            if part in RUN_DIR_NAMES or part.startswith(RUN_DIR_PREFIXES)
        ]
        built += [
            f"{where} line {node.lineno}: {ast.unparse(node)} kept as a name"
            for node in _kept_file_names(tree, RUN_DIR_NAMES)
        ]
    assert not built, (
        f"run-dir paths built outside launcher/base/run_dir.py (name them in RunDir there, and use that): {built}"
    )


LIVENESS_MODULE = PACKAGE / "base" / "liveness.py"


def test_only_liveness_py_names_seconds():
    """Every heartbeat, poll interval and fixed timeout is in liveness.py, once (issue 37: two BEAT_S and three
    POLL_S meant different things): no other module defines a module-level ``*_S`` constant."""
    own = [
        f"{path.relative_to(PACKAGE)}: {target.id}"
        for path in MODULES
        if path != LIVENESS_MODULE
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and target.id.isupper() and target.id.endswith("_S")
    ]
    assert not own, f"name them in launcher/base/liveness.py: {own}"


def test_the_trainer_is_a_class_of_owned_components_not_of_mixins():
    """``class Trainer`` has no base class (issue 37: it was assembled from three mixins reading each other's
    attributes); every attribute it assigns is declared, typed, at the class head."""
    tree = ast.parse((PACKAGE / "train" / "trainer.py").read_text())
    (trainer,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    assert not trainer.bases, [ast.unparse(base) for base in trainer.bases]
    declared = {node.target.id for node in trainer.body if isinstance(node, ast.AnnAssign)}
    assigned = {
        target.attr
        for node in ast.walk(trainer)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for whole in (node.targets if isinstance(node, ast.Assign) else [node.target])
        for target in (whole.elts if isinstance(whole, ast.Tuple) else [whole])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }
    assert assigned <= declared, f"assigned but not declared at the class head: {sorted(assigned - declared)}"
    assert "getattr(self" not in ast.unparse(trainer)


LAYOUT = PACKAGE.parent / "docs" / "layout.md"


def layout_lines() -> dict[str, str]:
    """docs/layout.md's module lines: ``launcher/...py`` -> its line."""
    found = re.findall(r"^- `(launcher/[\w/]+\.py)`: (.+)$", LAYOUT.read_text(), flags=re.MULTILINE)
    return dict(found)


def test_the_layout_page_names_every_module_with_a_line():
    """docs/layout.md lists every module of the package with one line (issue 37: the README's layout left out 14;
    issue 40: one line each)."""
    lines = layout_lines()
    missing = [str(p.relative_to(PACKAGE.parent)) for p in MODULES if str(p.relative_to(PACKAGE.parent)) not in lines]
    assert not missing, f"docs/layout.md has no line '- `<module>`: what it is' for {missing}"


def test_the_readme_is_a_front_page():
    """Issue 40: the README was a 1,300-line wall; now at most 250 lines, the manual is docs/ (mkdocs)."""
    lines = (PACKAGE.parent / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; HINT: move the detail to a page in docs/"


def test_the_layout_page_names_only_modules_that_exist():
    gone = [name for name in layout_lines() if not (PACKAGE.parent / name).is_file()]
    assert not gone, f"docs/layout.md names modules that do not exist: {gone}"


# ------------------------------------------------------------------------------------------------ the tests' own
# The suite is in four tiers, one folder each (tests/README.md). A test module is imported by its basename (pytest
# puts its folder on sys.path; a rank's function is pickled by that name): no __init__.py in a tier, and no two test
# modules of one name. What test modules share lives in tests/harness/ or a conftest.py: a test module that imports
# another runs the other's module-level code and fixtures, and ties the tiers together.
TIERS = ("rules", "ranks", "jobs", "beds")


def _imported_test_modules(path: Path) -> list[str]:
    """``line N: name`` of every import in ``path`` whose top-level module is a test module (``test_*``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names if name.split(".")[0].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    imports = {
        str(path.relative_to(TESTS)): found
        for path in sorted(TESTS.rglob("*.py"))
        if (found := _imported_test_modules(path))
    }
    assert not imports, f"imports of test modules (move what they share to tests/harness/ or a conftest.py): {imports}"


def test_every_test_module_sits_in_a_tier_folder():
    modules = sorted(TESTS.rglob("test_*.py"))
    misplaced = [str(p.relative_to(TESTS)) for p in modules if p.parent.parent != TESTS or p.parent.name not in TIERS]
    assert not misplaced, f"test modules outside tests/{{{','.join(TIERS)}}}/: {misplaced}"
    packages = [str(p.relative_to(TESTS)) for tier in TIERS for p in (TESTS / tier).rglob("__init__.py")]
    assert not packages, f"a tier is no package (its modules are imported by their basename): {packages}"
    names = [p.name for p in modules]
    assert len(set(names)) == len(names), sorted({n for n in names if names.count(n) > 1})
