"""Relay: this host's store fetches a box of a blob held by a remote store once and serves it to local ranks.

Without it, every rank of a host that needs the same remote bytes pulls them across the network itself.
Concurrent requests for the same piece wait for the first fetch (single flight). Cached pieces count
against the memory limit and stay until the local version (job, step) is deleted or dropped explicitly.
A piece is keyed by the save it was read from (`save_id`): a request for one save is never answered with
another's bytes; the fetch itself is a checked network read (trailer checksums) of that save.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from .boxio import blob_array
from .catalog import Blob, Catalog, check_save_id
from .checksum import chunk_digests
from .client import StoreClient
from .keys import check_box, check_job, check_name, check_step

Key = tuple[str, str, int, str, str, str | None]


class RelayCache:
    """Relayed pieces in `catalog`'s memory, fetched with clients made by `connect(peer_url)`."""

    def __init__(self, catalog: Catalog, connect: Callable[[str], StoreClient]) -> None:
        self.catalog, self.connect = catalog, connect
        self.blobs: dict[Key, Blob] = {}
        self._pending: dict[Key, threading.Event] = {}
        self._lock = threading.Lock()

    def get(self, body: dict[str, Any]) -> Blob:
        """The cached piece named by a relay request body, fetching it first if needed."""
        peer, job = str(body.get("peer")), check_job(body.get("job"))
        step, name = check_step(body.get("step")), check_name(body.get("name"))
        box, save_id = body.get("box"), body.get("save_id")
        save_id = None if save_id is None else check_save_id(save_id)
        key = (peer, job, step, name, json.dumps(box), save_id)
        while True:
            with self._lock:
                blob = self.blobs.get(key)
                if blob is not None:
                    return blob
                event = self._pending.get(key)
                mine = event is None
                if mine:
                    event = self._pending[key] = threading.Event()
            if not mine:
                event.wait(600)
                continue
            try:
                blob = self._fetch(peer, job, step, name, box, save_id)
                with self._lock:
                    self.blobs[key] = blob
                return blob
            finally:
                with self._lock:
                    self._pending.pop(key, None)
                event.set()

    def _fetch(self, peer: str, job: str, step: int, name: str, box: Any, save_id: str | None) -> Blob:
        c = self.connect(peer)  # a fresh client each time: the peer proves itself before each fetch
        try:
            info = c.blob_info(job, step, name, save_id)
            b = check_box(box, tuple(info["shape"]))
            blob = self.catalog.new_blob(f"relay {peer} {job}@{step}/{name}", info["dtype"], b.shape)
            try:
                out = blob_array(memoryview(blob.mem), blob.dtype, blob.shape)
                c.read_box(job, step, name, b, out, save_id)
            except BaseException:
                self.catalog.drop(blob)
                raise
        finally:
            c.close()
        blob.digests = chunk_digests(memoryview(blob.mem))
        blob.sealed = True
        return blob

    def drop(self, job: str, step: int | None) -> int:
        """Free cached pieces of `job` (at `step`, or every step when None)."""
        with self._lock:
            keys = [k for k in self.blobs if k[1] == job and (step is None or k[2] == step)]
            gone = [self.blobs.pop(k) for k in keys]
        for b in gone:
            self.catalog.drop(b)
        return len(gone)

    def close(self) -> None:
        with self._lock:
            gone, self.blobs = list(self.blobs.values()), {}
        for b in gone:
            b.release()
