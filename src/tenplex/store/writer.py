"""A client's writes: on this host allocated in the store's shared memory, copied and checksummed in one
pass, then sealed; over the network sent as raw chunks with the checksums the daemon must agree with."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, TypedDict, Unpack
from urllib.parse import quote

import numpy as np

from .boxio import as_bytes
from .checksum import chunk_digests, chunks, copy_hashed, digest, list_digest
from .errors import ChecksumError, ConflictError, NotFoundError
from .keys import (
    NUMPY_DTYPE,
    blob_path,
    check_dtype,
    check_name,
    check_shape,
    dtype_name_of,
    save_query,
    version_path,
)
from .same_host import SameHost
from .transport import Transport

MAX_BATCH = 4096  # blobs in one allocate or seal request (the daemon's `version_routes.MAX_BOXES`)


class SaveOf(TypedDict, total=False):
    """Which save a raw write belongs to, and whose copy it is (`replica_of`: replication)."""

    save_id: str | None
    replica_of: str | None


class BlobWriter:
    """The write path of one client; remembers what it allocated until it is sealed."""

    def __init__(self, transport: Transport, same_host: SameHost) -> None:
        self.transport = transport
        self.same_host = same_host
        self._allocated: dict[tuple[str, int, str], Any] = {}
        self._lock = threading.Lock()

    def write(
        self,
        job: str,
        step: int,
        name: str,
        array: np.ndarray,
        dtype: str | None = None,
        save_id: str | None = None,
    ) -> None:
        """Store `array` (C order) as blob `name` of the uncommitted version `step` (of the save `save_id`);
        `dtype` names the tenplex dtype when numpy has none (bfloat16 passed as a 2-byte integer array)."""
        dt = dtype_name_of(array, dtype)
        src = array if array.flags.c_contiguous else array.copy(order="C")
        if self.transport.is_local:
            dst = self.allocate(job, step, name, dt, src.shape, save_id)
            self._seal(job, step, name, copy_hashed(as_bytes(src), as_bytes(dst)), save_id)
            return
        pieces = chunks(as_bytes(src))
        self.put(job, step, name, dt, src.shape, pieces, [digest(p) for p in pieces], save_id=save_id)

    def write_many(
        self,
        job: str,
        step: int,
        items: Sequence[tuple[str, np.ndarray, str | None]],
        save_id: str | None = None,
    ) -> None:
        """`write_blob` for many (name, array, dtype) at once: on this host one allocate and one seal
        request for all of them (a request costs far more than the copy of a small tensor: "net one-element
        box, one request each" of `python benchmarks/bench_store.py` in results/bench_store.json), each
        blob copied and checksummed chunk by chunk in one pass; over the network one PUT each."""
        if not self.transport.is_local:
            for name, array, dtype in items:
                self.write(job, step, name, array, dtype, save_id)
            return
        for start in range(0, len(items), MAX_BATCH):
            part = items[start : start + MAX_BATCH]
            srcs = [a if a.flags.c_contiguous else a.copy(order="C") for _, a, _ in part]
            specs = [{"name": check_name(n), "dtype": dtype_name_of(a, dt), "shape": list(a.shape)}
                     for (n, a, dt) in part]  # fmt: skip
            payload: dict[str, Any] = {"blobs": specs}
            if save_id is not None:
                payload["save_id"] = save_id
            infos = self.transport.request("POST", f"{version_path(job, step)}/allocate", payload)["blobs"]
            sealed = []
            for spec, info, src in zip(specs, infos, srcs, strict=True):
                dst = self.same_host.map(info, writable=True)
                sealed.append({"name": spec["name"], "digests": copy_hashed(as_bytes(src), dst)})
            self.transport.request(
                "POST", f"{version_path(job, step)}/seal", {"blobs": sealed, "save_id": save_id}
            )

    def put(
        self,
        job: str,
        step: int,
        name: str,
        dtype: str,
        shape: Sequence[int],
        pieces: Sequence[memoryview],
        digests: list[int],
        **save: Unpack[SaveOf],
    ) -> None:
        """A network write of raw C-order bytes in CHUNK-sized pieces, refused unless the daemon hashed
        them as `digests`."""
        shape_q = ",".join(str(s) for s in shape)
        path = f"{blob_path(job, step, name)}?dtype={check_dtype(dtype)}&shape={shape_q}"
        path += f"&digest={list_digest(digests):016x}" + save_query(save.get("save_id"), "&")
        replica_of = save.get("replica_of")
        if replica_of is not None:
            path += f"&replica_of={quote(replica_of, safe='')}"
        theirs = self.transport.request("PUT", path, body=pieces)["digests"]
        if theirs != digests:
            raise ChecksumError(
                f"blob {name!r} arrived at {self.transport.url} with different bytes than were sent"
            )

    def allocate(
        self, job: str, step: int, name: str, dtype: str, shape: Sequence[int], save_id: str | None = None
    ) -> np.ndarray:
        """Same host only: a writable array mapped on the blob's shared memory; fill it, then `seal_blob`."""
        if not self.transport.is_local:
            raise ConflictError(f"allocate_blob needs a store on this host; {self.transport.url} is remote")
        payload: dict[str, Any] = {"dtype": check_dtype(dtype), "shape": list(check_shape(tuple(shape)))}
        if save_id is not None:
            payload["save_id"] = save_id
        info = self.transport.request("POST", f"{blob_path(job, step, name)}/allocate", payload)
        mem = self.same_host.map(info, writable=True)
        arr = np.frombuffer(mem, dtype=NUMPY_DTYPE[dtype]).reshape(tuple(shape))
        with self._lock:
            self._allocated[(job, step, name)] = (arr, save_id)
        return arr

    def seal(self, job: str, step: int, name: str) -> None:
        """Declare an allocated blob fully written: its checksums are taken now (sealed as the save it was
        allocated for: the store refuses it if that save's version was replaced meanwhile)."""
        with self._lock:
            arr, save_id = self._allocated.get((job, step, name), (None, None))
        if arr is None:
            raise NotFoundError(f"blob {name!r} was not allocated by this client")
        self._seal(job, step, name, chunk_digests(as_bytes(arr)), save_id)

    def _seal(self, job: str, step: int, name: str, digests: list[int], save_id: str | None = None) -> None:
        self.transport.request(
            "POST", f"{blob_path(job, step, name)}/seal", {"digests": digests, "save_id": save_id}
        )
        with self._lock:
            self._allocated.pop((job, step, name), None)
