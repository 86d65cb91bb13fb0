"""The house rules that keep launcher/ readable, read from the code: no module over 300 lines, no function over
80 (a longer one is split by concern, as comm/reducer.py was)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "launcher"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 80
MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_its_functions_are_small(path):
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE.parent)}: {lines} lines (> {MAX_MODULE_LINES})"
    long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(PACKAGE.parent)}: functions over {MAX_FUNCTION_LINES} lines: {long}"
