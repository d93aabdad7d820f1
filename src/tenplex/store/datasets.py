"""Read-only dataset views: a rank's sample stream served by the store (the paper's MLFS dataset mount).

A corpus built by `tenplex.data.build_corpus` is *registered* with a store under a name; the daemon maps its
token file read-only (nothing is copied, RSS does not grow with the corpus). For a sampler position
(`ElasticSampler.state_dict()`: seed, global batch, epoch, consumed), a dp size and a rank, the store lists
the rank's sample ids of the next k global batches — computed by `ElasticSampler` itself, so there is one
definition of the order — and serves the samples' tokens: as raw bytes over the network, or, for a
same-host client, by telling it the token file so that it gathers straight from its own memory map.

Sample i is tokens[i*seq : i*seq + seq + 1], as in `TokenWindows`.

Dependency: this module imports `tenplex.data` (the corpus format version and `ElasticSampler`, the one
definition of the sample order). `store` and `data` are one layer (DESIGN.md); the arrow is one-way:
`data` never imports `store`. Both are torch-free.

Trust model: the corpus directory is a path on the daemon's host and registering it is a request like any
other (it needs an authenticated connection, as every request does). The daemon only
ever maps `<dir>/<split>.bin`, and only when `<dir>/meta.json` is a corpus description as `build_corpus`
writes it (format version, integer token dtype, the split's token count) and the `.bin` file is a regular
file (no symlink) whose size matches that count exactly. So a registration cannot make the daemon read an
arbitrary file: it can read only `train.bin`/`val.bin` files sitting beside a matching `meta.json`. Whoever
holds the token can still read any such corpus the daemon's user can read; run the store as a user that
should be allowed to read the corpora it serves.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.corpus import FORMAT_VERSION
from ..data.sampler import ElasticSampler, SamplerError
from .errors import BadRequestError, NotFoundError
from .keys import check_job

TOKEN_DTYPES = ("uint8", "int16", "int32", "int64")  # token dtypes a corpus may declare
MAX_META = 1 << 20  # bytes of meta.json read at most
MAX_SEQ = 1 << 24
MAX_STEPS = 4096  # global batches listed by one request
MAX_IDS = 1 << 22  # ids listed or read by one request
STATE_KEYS = ("num_samples", "global_batch", "seed", "epoch", "consumed")


@dataclass
class Dataset:
    """One registered corpus split: its token file mapped read-only and its window geometry."""

    name: str
    corpus: str  # real path of the corpus directory
    split: str
    seq: int
    dtype: str
    path: str  # real path of the token file
    tokens: int
    tokens_map: np.ndarray  # np.memmap of the whole token file (never read at registration)

    @property
    def num_samples(self) -> int:
        return max(0, (self.tokens - 1) // self.seq)

    def windows(self) -> np.ndarray:
        """[num_samples, seq+1] view of overlapping windows on the mapping (no copy)."""
        return token_windows(self.tokens_map, self.seq, self.num_samples)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "corpus": self.corpus, "split": self.split, "seq": self.seq,
                "dtype": self.dtype, "tokens": self.tokens, "num_samples": self.num_samples,
                "path": self.path, "nbytes": self.tokens * np.dtype(self.dtype).itemsize}  # fmt: skip


def token_windows(tokens: np.ndarray, seq: int, num_samples: int) -> np.ndarray:
    """Sample i = row i = tokens[i*seq : i*seq+seq+1], as a strided view, so a gather reads the map once."""
    item = tokens.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        tokens, shape=(num_samples, seq + 1), strides=(seq * item, item), writeable=False
    )


def gather(win: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """out[j] = win[ids[j]], in blocks of about 1 MiB. Not `np.take`: on a strided view it first copies the
    whole view (every window of the corpus) into a contiguous array, faulting in the entire map."""
    k = max(1, (1 << 20) // max(1, win[0].nbytes))
    for i in range(0, len(ids), k):
        out[i : i + k] = win[ids[i : i + k]]


def _open_nofollow(path: str) -> int:
    """A regular file opened read-only; symlinks are refused, so a corpus cannot point elsewhere."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BadRequestError(f"{path} does not exist: not a tenplex corpus") from None
    except OSError as e:
        raise BadRequestError(f"cannot open {path}: {e.strerror} (symlinks are refused)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadRequestError(f"{path} is not a regular file")
    return fd


def open_dataset(name: str, corpus_dir: object, split: object, seq: object) -> Dataset:
    """Validate a corpus directory on this host and map its split read-only (see the trust model above)."""
    name = check_job(name)
    if not isinstance(corpus_dir, str) or not corpus_dir or "\0" in corpus_dir or len(corpus_dir) > 4096:
        raise BadRequestError("corpus_dir must be a path on the store's host")
    if not os.path.isabs(corpus_dir):
        raise BadRequestError(f"corpus_dir must be absolute (the store resolves it, not you): {corpus_dir!r}")
    if split not in ("train", "val"):
        raise BadRequestError(f"unknown split {split!r} (train or val)")
    if type(seq) is not int or not 0 < seq <= MAX_SEQ:
        raise BadRequestError(f"seq must be a positive integer up to {MAX_SEQ}, got {seq!r}")
    real = os.path.realpath(corpus_dir)
    if not os.path.isdir(real):
        raise BadRequestError(f"{corpus_dir} is not a directory on the store's host")
    fd = _open_nofollow(os.path.join(real, "meta.json"))
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_META + 1)
    try:
        meta = json.loads(raw) if len(raw) <= MAX_META else None
        info = meta["splits"][split]
        tokens, dtype = info["tokens"], meta["dtype"]
        ok = (
            meta["version"] == FORMAT_VERSION
            and dtype in TOKEN_DTYPES
            and type(tokens) is int
            and tokens >= 0
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise BadRequestError(f"{corpus_dir}/meta.json is not a tenplex corpus description (build_corpus)")
    item = np.dtype(dtype).itemsize
    bin_path = os.path.join(real, f"{split}.bin")
    fd = _open_nofollow(bin_path)
    try:
        size = os.fstat(fd).st_size
        if size != tokens * item:
            raise BadRequestError(f"{bin_path} has {size} bytes, meta.json says {tokens} {dtype} tokens")
        if (tokens - 1) // seq < 1:
            raise BadRequestError(f"split {split!r} has {tokens} tokens, fewer than one sample of {seq + 1}")
        # mapped, never read here: pages are faulted in by the reads that need them
        with open(fd, "rb", closefd=False) as f:
            mapped = np.memmap(f, dtype=np.dtype(dtype), mode="r", shape=(tokens,))
    finally:
        os.close(fd)
    return Dataset(name, real, split, seq, dtype, bin_path, tokens, mapped)


def _state(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict) or set(raw) != set(STATE_KEYS):
        raise BadRequestError(f"sampler must be ElasticSampler.state_dict(): keys {', '.join(STATE_KEYS)}")
    if not all(type(raw[k]) is int and 0 <= raw[k] < 2**63 for k in STATE_KEYS):
        raise BadRequestError(f"sampler state values must be non-negative integers, got {raw}")
    return dict(raw)


def rank_view(ds: Dataset, sampler: object, dp: object, rank: object, steps: object) -> dict[str, Any]:
    """Rank `rank`'s ids for the next `steps` global batches, computed by `ElasticSampler` from `sampler`."""
    state = _state(sampler)
    if type(dp) is not int or type(rank) is not int:
        raise BadRequestError("dp and rank must be integers")
    if type(steps) is not int or not 0 < steps <= MAX_STEPS:
        raise BadRequestError(f"steps must be an integer in 1..{MAX_STEPS}, got {steps!r}")
    if state["num_samples"] != ds.num_samples:
        raise BadRequestError(
            f"sampler state is for {state['num_samples']} samples; dataset {ds.name!r} has {ds.num_samples} "
            f"(seq={ds.seq})"
        )
    if steps * -(-state["global_batch"] // max(1, dp)) > MAX_IDS:
        raise BadRequestError(f"{steps} steps of {state['global_batch']} samples: list fewer steps at once")
    try:
        s = ElasticSampler(ds.num_samples, state["global_batch"], state["seed"])
        s.load_state_dict(state)
        s.check_dp(dp)
        start = s.state_dict()
        out = []
        for _ in range(steps):
            out.append(s.rank_ids(dp, rank).tolist())
            s.advance()
    except SamplerError as e:
        raise BadRequestError(str(e)) from None
    return {"ids": out, "start": start, "next": s.state_dict(), "seq": ds.seq, "dtype": ds.dtype}


def check_ids(ds: Dataset, raw: object) -> np.ndarray:
    if not isinstance(raw, list) or len(raw) > MAX_IDS or not all(type(i) is int for i in raw):
        raise BadRequestError(f"ids must be a list of at most {MAX_IDS} integers")
    ids = np.asarray(raw, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= ds.num_samples):
        raise BadRequestError(f"sample ids out of range [0, {ds.num_samples}) of dataset {ds.name!r}")
    return ids


class Registry:
    """The daemon's registered datasets, by name; re-registering a name replaces its mapping."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: dict[str, Dataset] = {}

    def add(self, ds: Dataset) -> None:
        with self.lock:
            self.items[ds.name] = ds

    def get(self, name: str) -> Dataset:
        with self.lock:
            ds = self.items.get(check_job(name))
        if ds is None:
            raise NotFoundError(f"unknown dataset {name!r}")
        return ds

    def drop(self, name: str) -> None:
        with self.lock:
            if self.items.pop(check_job(name), None) is None:
                raise NotFoundError(f"unknown dataset {name!r}")

    def list(self) -> list[dict[str, Any]]:
        with self.lock:
            return [self.items[n].info() for n in sorted(self.items)]
