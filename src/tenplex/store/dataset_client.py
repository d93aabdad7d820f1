"""A client's dataset views (a part of `StoreClient`): register a corpus with a store, list a rank's sample
ids, read token windows (same host: gathered from this process's own read-only map of the corpus file)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..ptc import Box
from .datasets import gather, token_windows
from .errors import BadRequestError, StoreError
from .keys import NUMPY_DTYPE, check_job, check_out
from .mappings import Mappings
from .read_body import into
from .transport import Transport


class Datasets:
    """A client's dataset routes (`StoreClient.register_dataset`, `read_samples`, ... call these)."""

    def __init__(self, transport: Transport, maps: Mappings) -> None:
        self.transport = transport
        self.maps = maps

    def register(self, name: str, corpus_dir: str | os.PathLike, split: str = "train", *, seq: int) -> dict:
        """Have the store map `corpus_dir` (a `build_corpus` directory *on the store's host*; made absolute
        here) read-only under `name`; returns its info (tokens, num_samples, ...). Re-registering replaces."""
        payload = {"corpus_dir": os.path.abspath(os.fspath(corpus_dir)), "split": split, "seq": seq}
        return self.transport.request("POST", f"/v1/datasets/{check_job(name)}", payload)

    def listing(self) -> list[dict[str, Any]]:
        return self.transport.request("GET", "/v1/datasets")["datasets"]

    def info(self, name: str) -> dict[str, Any]:
        return self.transport.request("GET", f"/v1/datasets/{check_job(name)}")

    def drop(self, name: str) -> None:
        self.transport.request("DELETE", f"/v1/datasets/{check_job(name)}")

    def ids(
        self, name: str, sampler_state: dict[str, int], dp: int, rank: int, steps: int = 1
    ) -> list[np.ndarray]:
        """Rank `rank` of `dp`'s sample ids for the next `steps` global batches from the position in
        `sampler_state` (`ElasticSampler.state_dict()`), as the store's `ElasticSampler` computes them."""
        payload = {"sampler": {k: int(v) for k, v in dict(sampler_state).items()}, "dp": dp, "rank": rank,
                   "steps": steps}  # fmt: skip
        ids = self.transport.request("POST", f"/v1/datasets/{check_job(name)}/ids", payload)["ids"]
        return [np.asarray(step, dtype=np.int64) for step in ids]

    def read_samples(self, name: str, ids: Sequence[int] | np.ndarray, out: np.ndarray) -> None:
        """Token windows `ids` ([n, seq+1], sample i = tokens[i*seq : i*seq+seq+1]) into `out` (C-contiguous,
        the corpus dtype). Same host: gathered straight from this process's read-only map of the corpus file;
        otherwise the store sends the raw bytes."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not isinstance(out, np.ndarray) or out.ndim != 2 or out.shape[0] != len(ids):
            raise BadRequestError(f"out must be an array of shape [{len(ids)}, seq+1]")
        if self.transport.is_local:
            info = self.info(name)
            check_out(out, info["dtype"], Box.full((len(ids), info["seq"] + 1)))
            if ids.size and (ids.min() < 0 or ids.max() >= info["num_samples"]):
                raise BadRequestError(
                    f"sample ids out of range [0, {info['num_samples']}) of dataset {name!r}"
                )
            win = token_windows(self._corpus_map(info), info["seq"], info["num_samples"])
            gather(win, ids, out.view(NUMPY_DTYPE[info["dtype"]]))
            return
        self.transport.request(
            "POST", f"/v1/datasets/{check_job(name)}/read", {"ids": ids.tolist()}, reader=into([out])
        )

    def rank_samples(
        self, name: str, sampler_state: dict[str, int], dp: int, rank: int, steps: int = 1
    ) -> list[np.ndarray]:
        """`ids` then `read_samples`: rank `rank`'s token windows of the next `steps` batches."""
        info = self.info(name)
        dtype, seq = NUMPY_DTYPE[info["dtype"]], info["seq"]
        out = []
        for ids in self.ids(name, sampler_state, dp, rank, steps):
            out.append(np.empty((len(ids), seq + 1), dtype=dtype))
            self.read_samples(name, ids, out[-1])
        return out

    def _corpus_map(self, info: dict[str, Any]) -> np.ndarray:
        """A cached read-only map of a corpus token file (corpus directories are immutable once built)."""

        def open_() -> np.ndarray:
            if os.path.getsize(info["path"]) != info["nbytes"]:
                raise StoreError(f"{info['path']} changed size since the store registered it")
            dtype = NUMPY_DTYPE[info["dtype"]]
            return np.memmap(info["path"], dtype=dtype, mode="r", shape=(info["tokens"],))

        return self.maps.get((info["path"], info["nbytes"], False), open_)
