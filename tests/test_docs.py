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


def test_the_readme_fits_on_a_screen():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
