"""The README and docs/: every relative link leads to a file that exists and, with `#anchor`, to a heading."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, code = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            code = not code
        elif not code and (m := re.match(r"#{1,6} (.*)", line)):
            out.add(slug(m.group(1)))
    return out


def test_slugs_are_githubs():
    assert slug("`tenplex run`: the elastic runtime") == "tenplex-run-the-elastic-runtime"
    assert slug("Quick start: your own training script") == "quick-start-your-own-training-script"
    assert slug("`tenplex plan` — explain a reconfiguration") == "tenplex-plan--explain-a-reconfiguration"


def test_every_relative_link_resolves():
    broken, checked = [], 0
    for doc in documents():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert checked >= 20, checked  # the README's and docs/index.md's links at least


def _resolves(dotted: str) -> bool:
    """`tenplex.a.b.name`: the longest prefix that is a module of src/, then a name that module defines."""
    parts = dotted.split(".")
    base = ROOT / "src"
    path, rest = None, parts
    for i in range(len(parts), 0, -1):
        stem = base.joinpath(*parts[:i])
        for candidate in (stem / "__init__.py", stem.with_suffix(".py"), stem):
            if candidate.exists():  # a module, a package, or a namespace package (a folder)
                path, rest = candidate, parts[i:]
                break
        if path:
            break
    if path is None:
        return False
    if not rest:
        return True
    if path.is_dir():
        return False
    # a name the module defines or imports (its own attributes, e.g. a method, are not checked)
    name = rest[0]
    pattern = rf"(def|class) {name}\b|^{name}\b.*=|import .*\b{name}\b|\"{name}\"|^    {name}\b"
    return re.search(pattern, path.read_text(), re.M) is not None


def test_every_module_and_name_the_docs_mention_exists():
    """`tenplex.x.y` in the README and docs/ (commands, imports, `tenplex.store.StoreClient`) still exists:
    modules were renamed and split while the docs were written."""
    missing, checked = [], 0
    for doc in documents():
        for dotted in sorted(set(re.findall(r"\btenplex(?:\.[A-Za-z_]\w*)+", doc.read_text()))):
            checked += 1
            if not _resolves(dotted):
                missing.append(f"{doc.relative_to(ROOT)}: {dotted}")
    assert not missing, "\n".join(missing)
    assert checked >= 20, checked
    assert not _resolves("tenplex.train.worker.init_distributed") and _resolves("tenplex.planner.assign")


def test_the_readme_fits_on_a_screen():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 215
