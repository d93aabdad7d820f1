"""The dependency line of the README, checked against the imports of every module of `src/tenplex`.

Every `import` and `from ... import` is read with `ast`, at any depth (a function-level import is a
dependency too; one under `if TYPE_CHECKING:` counts for the layers but not for cycles, since it never
runs). Rules: a module imports only its own layer or below; `util`, `ptc`, `planner`, `store` and
`deploy` reach no torch, not even through another module; `ElasticJob` (`tenplex.runtime.job`) reaches
no part of the reference workload (`tenplex.train`); no two modules import each other, directly or
around a circle.
Imports by name at run time (`importlib.import_module("...")`: the lazy attributes of `tenplex` and
`tenplex.train`, the CLI's command modules) are not seen.

Known violations that other work removes are listed in `ALLOWED`, each with the issue item that removes
it; an entry that no longer occurs fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tenplex"
TORCH_FREE = ("util", "ptc", "planner", "store", "deploy")

# (importer, imported) -> why it is still there and what removes it
ALLOWED: dict[tuple[str, str], str] = {}
# circles of modules -> what removes them
ALLOWED_CYCLES: dict[tuple[str, ...], str] = {}


def _layer_line() -> list[list[str]]:
    """The README's layer block, top first: each line the parts of one layer."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- layers:begin -->\s*```\n(.*?)```\s*<!-- layers:end -->", text, re.S)
    assert block, "README.md has no <!-- layers:begin --> ... <!-- layers:end --> block"
    return [[p.strip() for p in line.split("·")] for line in block.group(1).strip().splitlines()]


@cache
def layers() -> dict[str, int]:
    """Part (the name after `tenplex.`) -> its height: 0 for the bottom layer."""
    line = _layer_line()
    return {part: len(line) - 1 - i for i, parts in enumerate(line) for part in parts}


@cache
def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _typing_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


@cache
def imports(name: str) -> tuple[tuple[str, int, bool], ...]:
    """(imported module, line, typing only) for every import in module `name`."""
    path = modules()[name]
    return parse_imports(name, path.read_text(), path.name == "__init__.py")


def parse_imports(name: str, source: str, is_package: bool) -> tuple[tuple[str, int, bool], ...]:
    tree = ast.parse(source, name)
    typing_only = _typing_only(tree)
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in typing_only) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for a in node.names:  # `from pkg import mod` depends on pkg.mod, `from pkg import name` on pkg
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in modules() else base
                out.append((target, node.lineno, id(node) in typing_only))
    return tuple(out)


def part(module: str) -> str:
    """`tenplex.store.client` -> `store`; the package itself -> `tenplex`."""
    return module.split(".")[1] if module.count(".") else module


def internal(name: str, *, runtime_only: bool = False) -> set[str]:
    return {
        m for m, _, typing in imports(name) if m in modules() and m != name and not (runtime_only and typing)
    }


def reach(name: str) -> set[str]:
    """Every tenplex module `name` imports, directly or through others (imports that run)."""
    seen, todo = set(), [name]
    while todo:
        for m in internal(todo.pop(), runtime_only=True) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def violations() -> dict[tuple[str, str], str]:
    """(importer, imported) -> the rule it breaks, for the whole package."""
    height = layers()
    top = max(height.values()) + 1  # the `tenplex` facade: above everything, imported by no module
    out = {}
    for name in modules():
        if part(name) not in height and name != "tenplex":
            out[(name, "-")] = f"part {part(name)!r} is not in the README's layer line"
            continue
        mine = top if name == "tenplex" else height[part(name)]
        for m, line, _ in imports(name):
            if m in modules():
                theirs = top if m == "tenplex" else height.get(part(m), top)
                if theirs > mine:
                    out[(name, m)] = f"line {line}: {part(name)} imports {part(m)}, a layer above it"
            elif part(name) in TORCH_FREE and (m == "torch" or m.startswith("torch.")):
                out[(name, m)] = f"line {line}: {part(name)} must import no torch"
        if part(name) in TORCH_FREE:
            for m in sorted(reach(name)):
                torch = [t for t, _, _ in imports(m) if t == "torch" or t.startswith("torch.")]
                if torch and part(m) not in TORCH_FREE:  # torch-free parts are reported themselves
                    out[(name, m)] = f"{part(name)} reaches torch through {m}"
    job = "tenplex.runtime.job"
    for m in sorted(internal(job)):
        if part(m) == "train" or any(part(r) == "train" for r in reach(m)):
            out[(job, m)] = f"ElasticJob reaches the reference workload through {m}"
    return out


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(internal(v, runtime_only=True)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(modules()):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_readme_layer_line_names_every_part():
    parts = {part(m) for m in modules() if m != "tenplex"}
    assert parts <= set(layers()), f"parts not in the README's layer line: {sorted(parts - set(layers()))}"
    assert {"util", "ptc", "planner", "store", "transformer", "runtime", "cli"} <= set(layers())


def test_every_import_points_down_the_layer_line():
    found = violations()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    gone = sorted(k for k in ALLOWED if k not in found)
    assert not new, "imports against the layer line:\n" + "\n".join(
        f"{a} -> {b}: {w}" for (a, b), w in new.items()
    )
    assert not gone, f"no longer violations, remove them from ALLOWED: {gone}"


def test_no_import_cycle():
    found = {tuple(c): c for c in cycles()}
    new = [c for c in found if c not in ALLOWED_CYCLES]
    gone = sorted(c for c in ALLOWED_CYCLES if c not in found)
    assert not new, f"modules importing each other (directly or around a circle): {new}"
    assert not gone, f"no longer circles, remove them from ALLOWED_CYCLES: {gone}"


def test_the_checker_sees_what_it_should():
    """The analysis itself: relative, nested and `from pkg import module` imports resolve as Python does."""
    source = """
import torch.distributed as dist
from . import box
from .. import planner
from ..store import StoreClient
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from ..train import TrainConfig
def f():
    from ..transformer.load import load
"""
    got = {(m, typing) for m, _, typing in parse_imports("tenplex.ptc.mesh", source, False)}
    assert got == {
        ("torch.distributed", False),
        ("tenplex.ptc.box", False),
        ("tenplex.planner", False),
        ("tenplex.store", False),
        ("typing", False),
        ("tenplex.train", True),
        ("tenplex.transformer.load", False),
    }
    assert (
        parse_imports("tenplex.store", "from .client import StoreClient", True)[0][0]
        == "tenplex.store.client"
    )
    assert "tenplex.ptc" in internal("tenplex")
    assert "tenplex.planner.transport" in internal("tenplex.planner.assign")
    assert "tenplex.ptc" in reach("tenplex.planner.assign")
    assert "tenplex.store" in reach("tenplex.transformer.load")
    assert layers()["util"] == 0 and layers()["cli"] == max(layers().values())


def _environ_reads(source: str) -> list[str]:
    """`TENPLEX_*` names read straight from `os.environ` / `os.getenv` in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args:
            f = ast.unparse(node.func)
            if f.endswith(("environ.get", "environ.pop", "getenv")):
                key = node.args[0]
        if isinstance(key, ast.Constant) and str(key.value).startswith("TENPLEX_"):
            found.append(key.value)
    return found


def test_tenplex_variables_are_read_in_one_place():
    """Every `TENPLEX_*` variable is read through `tenplex.util.env` (issue 13: one place per process)."""
    offenders = {
        str(p.relative_to(PACKAGE)): names
        for p in sorted(PACKAGE.rglob("*.py"))
        if p != PACKAGE / "util" / "env.py" and (names := _environ_reads(p.read_text()))
    }
    assert offenders == {}
    assert _environ_reads('import os\nos.environ.get("TENPLEX_X")\nos.environ["TENPLEX_Y"]') == [
        "TENPLEX_X",
        "TENPLEX_Y",
    ]
