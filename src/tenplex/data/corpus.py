"""Real text as a memory-mapped byte-token file, with a document index and a held-out split.

The default corpus is the Python standard library source of the running interpreter: real text nobody here
wrote, present on every machine, nothing to download. Tokens are bytes (vocabulary 256, stored as uint8);
documents are separated by a NUL byte, which source text never contains. A file goes to the held-out split
by a hash of its relative path, so the split is stable when files are added.

Layout of a built corpus directory (written to a temporary name and renamed, so concurrent builders on the
same host never see a torn corpus):  meta.json, train.bin, val.bin, train.idx.npy, val.idx.npy
(.idx: int64 start offset of every document).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ptc import TenplexError
from ..util import env

SEPARATOR = 0
FORMAT_VERSION = 1
DEFAULT_SUFFIXES = (".py", ".txt", ".rst", ".md")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


class CorpusError(TenplexError, ValueError):
    """No usable text, or a corrupt corpus directory."""


def cache_dir() -> Path:
    """$TENPLEX_CACHE, else ~/.cache/tenplex."""
    return Path(env.get(env.CACHE) or Path.home() / ".cache" / "tenplex")


def default_sources() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


def _files(sources: Sequence[Path], suffixes: Sequence[str]) -> list[tuple[str, Path]]:
    """(stable relative name, path) of every text file under sources, sorted, site-packages skipped."""
    out: list[tuple[str, Path]] = []
    for i, src in enumerate(sources):
        src = Path(src)
        if src.is_file():
            out.append((f"{i}/{src.name}", src))
            continue
        if not src.is_dir():
            raise CorpusError(f"corpus source {src} does not exist")
        for root, dirs, names in os.walk(src):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
            for name in sorted(names):
                if name.endswith(tuple(suffixes)):
                    p = Path(root) / name
                    out.append((f"{i}/{p.relative_to(src).as_posix()}", p))
    return out


def _heldout(name: str, fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < fraction * 10_000


def _key(files: Iterable[tuple[str, Path]], fraction: float) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION} {fraction}".encode())
    for name, p in files:
        st = p.stat()
        h.update(f"{name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Corpus:
    """A built corpus directory; `tokens(split)` maps its token file read-only."""

    path: Path

    @property
    def meta(self) -> dict:
        return json.loads((self.path / "meta.json").read_text())

    def tokens(self, split: str = "train") -> np.ndarray:
        if split not in ("train", "val"):
            raise CorpusError(f"unknown split {split!r} (train or val)")
        f = self.path / f"{split}.bin"
        if f.stat().st_size == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(f, dtype=np.dtype(self.meta["dtype"]), mode="r")

    def doc_index(self, split: str = "train") -> np.ndarray:
        return np.load(self.path / f"{split}.idx.npy")


def build_corpus(
    sources: Sequence[str | Path] | None = None,
    *,
    root: Path | None = None,
    heldout: float = 0.02,
    suffixes: Sequence[str] = DEFAULT_SUFFIXES,
    force: bool = False,
) -> Corpus:
    """Build (or reuse the cached) corpus of `sources` (files or directories; default the stdlib)."""
    if not 0 <= heldout < 1:
        raise CorpusError(f"held-out fraction must be in [0, 1), got {heldout}")
    srcs = [Path(s) for s in sources] if sources else default_sources()
    files = _files(srcs, suffixes)
    if not files:
        raise CorpusError(f"no {'/'.join(suffixes)} files under {', '.join(map(str, srcs))}")
    root = Path(root) if root is not None else cache_dir() / "corpus"
    dest = root / _key(files, heldout)
    if (dest / "meta.json").exists() and not force:
        return Corpus(dest)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        counts = _write_splits(tmp, files, heldout)
        meta = {
            "version": FORMAT_VERSION,
            "dtype": "uint8",
            "vocab": 256,
            "separator": SEPARATOR,
            "sources": [str(s) for s in srcs],
            "heldout": heldout,
            "files": len(files),
            "splits": {s: {"documents": c[0], "tokens": c[1]} for s, c in counts.items()},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if force and dest.exists():
            shutil.rmtree(dest)
        try:
            tmp.rename(dest)
        except OSError:  # another builder won the race; its corpus is identical
            if not (dest / "meta.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Corpus(dest)


def _write_splits(tmp: Path, files: list[tuple[str, Path]], heldout: float) -> dict[str, list[int]]:
    """Each file's bytes and a separator into its split's `.bin`, and the split's document starts into its
    `.idx.npy`; per split, [documents, tokens]."""
    counts = {"train": [0, 0], "val": [0, 0]}
    starts: dict[str, list[int]] = {s: [] for s in counts}
    outs = {s: open(tmp / f"{s}.bin", "wb") for s in counts}  # noqa: SIM115 - closed below
    try:
        for name, p in files:
            data = p.read_bytes()
            if not data:
                continue
            split = "val" if _heldout(name, heldout) else "train"
            starts[split].append(counts[split][1])
            outs[split].write(data)
            outs[split].write(bytes([SEPARATOR]))
            counts[split][0] += 1
            counts[split][1] += len(data) + 1
    finally:
        for f in outs.values():
            f.close()
    for s in counts:
        np.save(tmp / f"{s}.idx.npy", np.asarray(starts[s], dtype=np.int64))
    return counts


class TokenWindows:
    """Samples of a token array: sample i is tokens[i*seq : i*seq + seq + 1] (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, seq: int) -> None:
        if seq < 1:
            raise CorpusError(f"sequence length must be positive, got {seq}")
        self.tokens, self.seq = tokens, seq
        self.num_samples = max(0, (len(tokens) - 1) // seq)
        if self.num_samples == 0:
            raise CorpusError(f"{len(tokens)} tokens are fewer than one sample of {seq + 1}")

    def __len__(self) -> int:
        return self.num_samples

    def get(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """[len(ids), seq+1] int64 token windows."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise CorpusError(f"sample ids out of range [0, {self.num_samples})")
        rows = ids[:, None] * self.seq + np.arange(self.seq + 1)  # one gather from the memory map
        return np.asarray(self.tokens[rows], dtype=np.int64)
