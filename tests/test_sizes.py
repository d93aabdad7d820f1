"""Small, flat code (issue 29): in the packages of `CHECKED`, no function is over `MAX_FUNCTION` lines and
no module over `MAX_MODULE` lines.

A function's lines run from its `def` to its last line, docstring and nested functions included (a
nested function counts for itself as well). Add a package to `CHECKED` once it passes; the ruff rules of
the same issue (C901, PLR0913) are enabled per package in pyproject.toml the same way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tenplex"
# every package of `tenplex` is held to the limits
CHECKED = (
    "cli",
    "data",
    "dcp",
    "deploy",
    "integrations",
    "planner",
    "ptc",
    "runtime",
    "store",
    "train",
    "transformer",
    "util",
)
MAX_FUNCTION = 60
MAX_MODULE = 400


def modules(package: str) -> list[Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


def long_functions(path: Path, limit: int = MAX_FUNCTION) -> list[str]:
    """`name:line (n lines)` of every function of `path` over `limit` lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > limit:
                found.append(f"{node.name}:{node.lineno} ({n} lines)")
    return found


def module_lines(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("package", CHECKED)
def test_no_function_over_the_limit(package):
    over = {str(p.relative_to(PACKAGE)): f for p in modules(package) if (f := long_functions(p))}
    assert not over, f"functions over {MAX_FUNCTION} lines: {over}"


@pytest.mark.parametrize("package", CHECKED)
def test_no_module_over_the_limit(package):
    over = {str(p.relative_to(PACKAGE)): n for p in modules(package) if (n := module_lines(p)) > MAX_MODULE}
    assert not over, f"modules over {MAX_MODULE} lines: {over}"


def test_the_checks_see_what_they_should(tmp_path):
    """The measures themselves: a long function and a long module are found, a short one is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    long = tmp_path / "long.py"
    long.write_text(f"def f():\n{body}\n\n\ndef g():\n    return 1\n")
    assert long_functions(long) == [f"f:1 ({MAX_FUNCTION + 1} lines)"]
    assert module_lines(long) == MAX_FUNCTION + 5
    assert all(modules(p) for p in CHECKED), "a checked package has no module (renamed?)"
