"""A house rule the linters cannot check: no measured figure in a comment or docstring (figures live in
`results/` and the docs generated from them; a comment names the benchmark instead)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "tenplex"
RATE = r"\d+(\.\d+)?(-\d+(\.\d+)?)? ?(KB|MB|GB|KiB|MiB|GiB)/s\b"
TIME = r"\d+(\.\d+)?(-\d+(\.\d+)?)? ?(ms|s|µs)\b"
FIGURE = re.compile(
    rf"{RATE}"  # a rate is always a measurement
    rf"|{TIME}.{{0,40}}\b(instead of|against|vs\.?|than)\b"  # a time set against another
    rf"|\bmeasured\b.{{0,80}}({TIME}|\d+(\.\d+)?x\b)"  # "measured: 1.3 s", "measured 3x"
    r"|\b\d+(\.\d+)?x (slower|faster|longer|more|less)\b",
    re.IGNORECASE,
)


def _prose(path: Path) -> list[tuple[int, str]]:
    """Every comment and docstring line of a module, with its line number."""
    text = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
           if t.type == tokenize.COMMENT]  # fmt: skip
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                first = node.body[0].lineno
                out += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def test_no_measured_figure_in_a_comment_or_docstring():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for line, text in _prose(path)
        if FIGURE.search(text)
    ]
    assert not found, "\n".join(found)


def test_the_pattern_finds_figures_and_passes_plain_prose():
    for figure in ("measured here: 2.0 GB/s into torch.empty", "made it 1.3 s instead of 0.4 s",
                   "(measured: a join of 1.9 s)", "took 2-3x longer"):  # fmt: skip
        assert FIGURE.search(figure), figure
    for prose in ("every 1 s", "the pick's measured step time is set against the best one (1.0: fastest)",
                  "a poll after its last member joins", "2 ms of line rate"):  # fmt: skip
        assert not FIGURE.search(prose), prose
