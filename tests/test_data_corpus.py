"""The corpus builder: real text to a memory-mapped token file, cached, with a stable held-out split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tenplex.data.corpus import CorpusError, TokenWindows, _files, build_corpus, cache_dir, default_sources


def _tree(root: Path, n: int = 40) -> Path:
    src = root / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(n):
        (src / "pkg" / f"m{i}.py").write_text(f"def f{i}():\n    return {i}\n" * (i + 1))
    (src / "skip.bin").write_bytes(b"\x01\x02")
    (src / "site-packages").mkdir()
    (src / "site-packages" / "x.py").write_text("no")
    return src


def test_build_splits_index_and_cache(tmp_path: Path) -> None:
    src = _tree(tmp_path)
    c = build_corpus([src], root=tmp_path / "cache", heldout=0.2)
    meta = c.meta
    assert meta["files"] == 40 and meta["dtype"] == "uint8"
    texts = sorted(p.read_bytes() for p in (src / "pkg").iterdir())
    tr, va = c.tokens("train"), c.tokens("val")
    assert len(tr) + len(va) == sum(len(t) + 1 for t in texts)
    assert 0 < meta["splits"]["val"]["documents"] < 40
    idx = c.doc_index("train")
    assert len(idx) == meta["splits"]["train"]["documents"] and idx[0] == 0
    docs = [bytes(tr[a : b - 1]) for a, b in zip(idx, [*idx[1:], len(tr)])]
    assert all(d in texts for d in docs) and all(tr[b - 1] == 0 for b in [*idx[1:], len(tr)])
    assert build_corpus([src], root=tmp_path / "cache", heldout=0.2).path == c.path  # cached
    (src / "pkg" / "m0.py").write_text("changed")
    assert build_corpus([src], root=tmp_path / "cache", heldout=0.2).path != c.path  # rebuilt on change


def test_windows(tmp_path: Path) -> None:
    c = build_corpus([_tree(tmp_path)], root=tmp_path / "c", heldout=0)
    tokens = c.tokens("train")
    w = TokenWindows(tokens, 16)
    assert len(w) == (len(tokens) - 1) // 16
    got = w.get([0, len(w) - 1])
    assert got.shape == (2, 17) and got.dtype == np.int64
    np.testing.assert_array_equal(got[0], tokens[:17])
    with pytest.raises(CorpusError):
        w.get([len(w)])
    with pytest.raises(CorpusError):
        TokenWindows(tokens[:5], 16)


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="does not exist"):
        build_corpus([tmp_path / "nope"], root=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no "):
        build_corpus([tmp_path / "empty"], root=tmp_path)
    with pytest.raises(CorpusError, match="held-out"):
        build_corpus([tmp_path], root=tmp_path, heldout=1.5)


def test_default_is_the_stdlib_without_site_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TENPLEX_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    files = _files(default_sources(), (".py",))
    assert len(files) > 500
    assert not any("site-packages" in name for name, _ in files)
    assert any(name.endswith("/json/__init__.py") for name, _ in files)
