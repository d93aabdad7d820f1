"""`StoreClient`: one interface, two paths — shared memory when the store is on this host, sockets otherwise.

Reads always land in caller-provided arrays (no intermediate `bytes`); connections are pooled and reused;
connection failures are retried with backoff (every request is idempotent); checksums are computed at write
and verified on every read, on whichever side touches the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any
from urllib.parse import quote

import numpy as np

from ..ptc import Box
from .boxio import as_bytes, blob_array, copy_box
from .checksum import CHUNK, byte_span, chunk_digests, chunks, copy_hashed, digest, list_digest, verify_span
from .dataset_client import DatasetClient
from .errors import BadRequestError, ChecksumError, ConflictError, NotFoundError, StoreError, StoreUnavailable
from .keys import (
    NUMPY_DTYPE,
    check_dtype,
    check_inside,
    check_job,
    check_name,
    check_out,
    check_shape,
    check_step,
    dtype_name_of,
)
from .protocol import Conn
from .shm import map_file, populate
from .transport import DEFAULT_PORT, DEFAULT_URL, into

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_URL",
    "Held",
    "StoreClient",
    "hold_relayed_many",
    "read_many",
    "relay_many",
]

BoxRequest = tuple[str, Box, np.ndarray]  # (blob name, box, out)


MAX_BATCH = 4096  # blobs in one allocate or seal request (the daemon's MAX_BOXES)
RELAY_BATCH = 256  # boxes in one relay request


class Held:
    """Verified boxes in a same-host store's memory (read-only views), and the hold on their blobs."""

    def __init__(self, arrays: list[np.ndarray], release: Callable[[], None]) -> None:
        self.arrays = arrays
        self._release: Callable[[], None] | None = release

    def close(self) -> None:
        """End the hold (once); the views must not be used after it."""
        release, self._release = self._release, None
        if release is not None:
            release()


class StoreClient(DatasetClient):
    """Client of one store daemon: versions, blobs, relay (here), datasets (`DatasetClient`), pooled
    connections with retries (`Transport`). Thread-safe: concurrent calls use separate connections."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        local: bool | None = None,
        timeout: float = 120.0,
        retries: int = 3,
    ) -> None:
        super().__init__(url, token, local, timeout, retries)
        self._allocated: dict[tuple[str, int, str], Any] = {}

    @staticmethod
    def _vpath(job: str, step: int) -> str:
        return f"/v1/jobs/{check_job(job)}/versions/{check_step(step)}"

    def _bpath(self, job: str, step: int, name: str) -> str:
        return f"{self._vpath(job, step)}/blobs/{quote(check_name(name), safe='')}"

    @staticmethod
    def _save_q(save_id: str | None, sep: str = "?") -> str:
        return "" if save_id is None else f"{sep}save_id={quote(save_id, safe='')}"

    # ------------------------------------------------------------------ control

    def stats(self) -> dict[str, Any]:
        return self.request("GET", "/v1/stats")

    def jobs(self) -> list[str]:
        return self.request("GET", "/v1/jobs")["jobs"]

    def version_info(self, job: str) -> list[dict[str, Any]]:
        """Every version of `job`, committed or not, with blob counts, sizes and replication state."""
        answer = self.request("GET", f"/v1/jobs/{check_job(job)}")
        versions = answer.get("versions") if isinstance(answer, dict) else None
        if not isinstance(versions, list):  # not a store's answer (another process on its port): no store
            raise StoreUnavailable(f"{self.url} did not answer as a store (no version listing)")
        return versions

    def versions(self, job: str) -> list[int]:
        """Committed steps of `job`, ascending ([] for an unknown job)."""
        try:
            return [v["step"] for v in self.version_info(job) if v["committed"]]
        except NotFoundError:
            return []

    def save_ids(self, job: str) -> dict[int, str | None]:
        """Committed steps of `job` and the save id each was committed with."""
        try:
            return {v["step"]: v.get("save_id") for v in self.version_info(job) if v["committed"]}
        except NotFoundError:
            return {}

    def committed_saves(self, job: str) -> dict[int, list[str | None]]:
        """Every committed save of `job` a read can name here, by step (newest first): a step being saved
        again keeps its earlier save readable beside the new one until the new one is known complete."""
        try:
            listing = self.version_info(job)
        except NotFoundError:
            return {}
        out = {v["step"]: list(v.get("saves", [v.get("save_id")] if v["committed"] else [])) for v in listing}
        return {s: ids for s, ids in out.items() if ids}

    def latest(self, job: str) -> int | None:
        steps = self.versions(job)
        return steps[-1] if steps else None

    def create_version(
        self, job: str, step: int, save_id: str | None = None, replica_of: str | None = None
    ) -> dict[str, Any]:
        """Open version `step` for the save `save_id` (an open version of another save, an abandoned
        attempt, is replaced); `replica_of`: a copy of that store's save (replication)."""
        payload = {k: v for k, v in (("save_id", save_id), ("replica_of", replica_of)) if v is not None}
        return self.request("POST", self._vpath(job, step), payload or None)

    def commit(
        self,
        job: str,
        step: int,
        manifest: Any,
        wait_replicas: bool = False,
        replica_of: str | None = None,
        blobs: list[str] | None = None,
        save_id: str | None = None,
    ) -> dict[str, Any]:
        """Make version `step` visible with its manifest, atomically; idempotent. With replication on,
        `wait_replicas=True` returns only after the copies are on the peers (asked in rounds shorter than
        the client's timeout, so a long push is never mistaken for a dead store and the commit retried).
        `blobs`: the names that make the version (each must be sealed); others, left by an abandoned
        attempt, are dropped. `save_id` (default: the manifest's) must be the one the version was opened
        for."""
        wait = self.timeout / 4 if wait_replicas else False  # a round always ends well inside the timeout
        payload: dict[str, Any] = {"manifest": manifest, "wait_replicas": wait, "replica_of": replica_of}
        if blobs is not None:
            payload["blobs"] = blobs
        if save_id is not None:
            payload["save_id"] = save_id
        info = self.request("POST", f"{self._vpath(job, step)}/commit", payload)
        while wait and info.get("replication") == "pending":  # committed; the copies are still on the way
            info = self.request("POST", f"{self._vpath(job, step)}/commit", payload)
        return info

    def manifest(self, job: str, step: int, save_id: str | None = None) -> Any:
        path = f"{self._vpath(job, step)}/manifest{self._save_q(save_id)}"
        return self.request("GET", path)["manifest"]

    def blobs(self, job: str, step: int, save_id: str | None = None) -> list[dict[str, Any]]:
        """Blobs of a committed version (of the save `save_id`, default the one the store shows): name,
        dtype, shape, nbytes, copies (URLs of stores holding it)."""
        return self.request("GET", f"{self._vpath(job, step)}/blobs{self._save_q(save_id)}")["blobs"]

    def blob_info(self, job: str, step: int, name: str, save_id: str | None = None) -> dict[str, Any]:
        return self.request("GET", self._bpath(job, step, name) + self._save_q(save_id))

    def delete_version(self, job: str, step: int, save_id: str | None = None) -> None:
        """Delete the step (every save and copy of it here); with `save_id`, only this store's open
        version of that save (a save that failed), leaving the step's committed save."""
        self.request("DELETE", self._vpath(job, step) + self._save_q(save_id, "?"))

    def delete_job(self, job: str) -> None:
        self.request("DELETE", f"/v1/jobs/{check_job(job)}")

    def retain(
        self,
        job: str,
        keep: int | None,
        protect: tuple[int, str | None] | None = None,
        replica_of: str | None = None,
    ) -> list[int]:
        """Keep the `keep` newest committed saves of `job` by commit order, and always `protect` (step,
        save id): the save just committed on every store, marked complete (`keep=None`: only that mark,
        and abandoned attempts before it dropped); without `protect`, the newest save ever marked
        complete is kept in its place, and nothing committed goes while none is. The store applies the
        same to its copies on its replication targets. `replica_of`: only that store's copies here.
        Returns the deleted steps."""
        shield = None if protect is None else list(protect)
        payload = {"keep": keep, "protect": shield, "replica_of": replica_of}
        return self.request("POST", f"/v1/jobs/{check_job(job)}/retain", payload)["deleted"]

    def delete_copy(self, job: str, step: int, replica_of: str, save_id: str) -> bool:
        """Delete `replica_of`'s copy of save `save_id` here (a partial push); it is never recreated."""
        q = f"?replica_of={quote(replica_of, safe='')}" + self._save_q(save_id, "&")
        return self.request("DELETE", self._vpath(job, step) + q)["deleted"] is not None

    def set_peers(self, peers: Sequence[str], replicas: int) -> list[str]:
        """Configure the store's replication ring; returns the peers it will copy committed versions to."""
        return self.request("POST", "/v1/peers", {"peers": list(peers), "replicas": replicas})["targets"]

    # ------------------------------------------------------------------ writing

    def write_blob(
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
        if self.is_local:
            dst = self.allocate_blob(job, step, name, dt, src.shape, save_id)
            self._seal(job, step, name, copy_hashed(as_bytes(src), as_bytes(dst)), save_id)
            return
        pieces = chunks(as_bytes(src))
        self.put_raw(job, step, name, dt, src.shape, pieces, [digest(p) for p in pieces], save_id=save_id)

    def write_blobs(
        self,
        job: str,
        step: int,
        items: Sequence[tuple[str, np.ndarray, str | None]],
        save_id: str | None = None,
    ) -> None:
        """`write_blob` for many (name, array, dtype) at once: on this host one allocate and one seal
        request for all of them (a request costs ~0.3 ms, the copy of a small tensor far less), each blob
        copied and checksummed chunk by chunk in one pass; over the network one PUT each."""
        if not self.is_local:
            for name, array, dtype in items:
                self.write_blob(job, step, name, array, dtype, save_id)
            return
        for start in range(0, len(items), MAX_BATCH):
            part = items[start : start + MAX_BATCH]
            srcs = [a if a.flags.c_contiguous else a.copy(order="C") for _, a, _ in part]
            specs = [{"name": check_name(n), "dtype": dtype_name_of(a, dt), "shape": list(a.shape)}
                     for (n, a, dt) in part]  # fmt: skip
            payload: dict[str, Any] = {"blobs": specs}
            if save_id is not None:
                payload["save_id"] = save_id
            infos = self.request("POST", f"{self._vpath(job, step)}/allocate", payload)["blobs"]
            sealed = []
            for spec, info, src in zip(specs, infos, srcs, strict=True):
                dst = self._map(info, writable=True)
                sealed.append({"name": spec["name"], "digests": copy_hashed(as_bytes(src), dst)})
            self.request("POST", f"{self._vpath(job, step)}/seal", {"blobs": sealed, "save_id": save_id})

    def put_raw(
        self,
        job: str,
        step: int,
        name: str,
        dtype: str,
        shape: Sequence[int],
        pieces: Sequence[memoryview],
        digests: list[int],
        replica_of: str | None = None,
        save_id: str | None = None,
    ) -> None:
        """Network write of raw C-order bytes in CHUNK-sized pieces; the daemon refuses them unless it
        hashed them as we did. `replica_of`: the store this blob is a copy of (replication)."""
        shape_q = ",".join(str(s) for s in shape)
        path = f"{self._bpath(job, step, name)}?dtype={check_dtype(dtype)}&shape={shape_q}"
        path += f"&digest={list_digest(digests):016x}" + self._save_q(save_id, "&")
        if replica_of is not None:
            path += f"&replica_of={quote(replica_of, safe='')}"
        theirs = self.request("PUT", path, body=pieces)["digests"]
        if theirs != digests:
            raise ChecksumError(f"blob {name!r} arrived at {self.url} with different bytes than were sent")

    def allocate_blob(
        self, job: str, step: int, name: str, dtype: str, shape: Sequence[int], save_id: str | None = None
    ) -> np.ndarray:
        """Same host only: a writable array mapped on the blob's shared memory; fill it, then `seal_blob`."""
        if not self.is_local:
            raise ConflictError(f"allocate_blob needs a store on this host; {self.url} is remote")
        payload: dict[str, Any] = {"dtype": check_dtype(dtype), "shape": list(check_shape(tuple(shape)))}
        if save_id is not None:
            payload["save_id"] = save_id
        info = self.request("POST", f"{self._bpath(job, step, name)}/allocate", payload)
        mem = self._map(info, writable=True)
        arr = np.frombuffer(mem, dtype=NUMPY_DTYPE[dtype]).reshape(tuple(shape))
        with self._lock:
            self._allocated[(job, step, name)] = (arr, save_id)
        return arr

    def seal_blob(self, job: str, step: int, name: str) -> None:
        """Declare an allocated blob fully written: its checksums are taken now (sealed as the save it was
        allocated for: the store refuses it if that save's version was replaced meanwhile)."""
        with self._lock:
            arr, save_id = self._allocated.get((job, step, name), (None, None))
        if arr is None:
            raise NotFoundError(f"blob {name!r} was not allocated by this client")
        self._seal(job, step, name, chunk_digests(as_bytes(arr)), save_id)

    def _seal(self, job: str, step: int, name: str, digests: list[int], save_id: str | None = None) -> None:
        self.request("POST", f"{self._bpath(job, step, name)}/seal", {"digests": digests, "save_id": save_id})
        with self._lock:
            self._allocated.pop((job, step, name), None)

    # ------------------------------------------------------------------ reading

    def read_box(
        self, job: str, step: int, name: str, box: Box, out: np.ndarray, save_id: str | None = None
    ) -> None:
        """Copy `box` of a committed blob into `out` (C-contiguous, shape == box.shape)."""
        self.read_boxes(job, step, [(name, box, out)], save_id)

    def read_boxes(
        self,
        job: str,
        step: int,
        requests: Sequence[BoxRequest],
        save_id: str | None = None,
        sums: dict[int, list[int]] | None = None,
    ) -> None:
        """Many boxes of one version in one request (same host: one lookup, then memory copies). With
        `save_id`, only that save's blobs are read (NotFoundError if the store holds another one). On an
        error the contents of the `out` arrays are undefined. `sums`: see `transport.into` (network
        reads only)."""
        for name, box, out in requests:
            check_name(name)
            if not isinstance(out, np.ndarray) or tuple(out.shape) != box.shape:
                raise BadRequestError(f"out for {name!r} must be an array of shape {list(box.shape)}")
        if not requests:
            return
        if self.is_local:
            by_name, release = self._locate(job, step, [r[0] for r in requests], save_id)
            try:
                for name, box, out in requests:
                    self._copy_local(by_name[name], box, out, f"{job}@{step}/{name}")
            finally:
                release()
            return
        payload = {"boxes": [{"name": n, "box": b.to_json()} for n, b, _ in requests], "save_id": save_id}
        self.request(
            "POST", f"{self._vpath(job, step)}/read", payload, reader=into([r[2] for r in requests], sums)
        )

    def hold_boxes(
        self, job: str, step: int, requests: Sequence[tuple[str, Box, str]], save_id: str | None = None
    ) -> Held:
        """Same host only: verify the chunks under every (blob, box, expected dtype) and keep the blobs
        held, so that the caller copies the boxes straight from shared memory into its own tensors later
        (`Held.arrays`, read-only views). A load writes its targets only once every rank verified its boxes;
        holding them spares the copy into scratch memory meanwhile, and fresh memory is what costs on a
        virtual machine (see docs/transformer.md). The bytes copied are the bytes verified: a held blob is
        sealed and its file is never recycled until `Held.close()` ends the hold."""
        self._check_holdable(requests, "read its boxes with read_boxes")
        if not requests:
            return Held([], lambda: None)
        by_name, release = self._locate(job, step, [r[0] for r in requests], save_id)
        return self._held([by_name[r[0]] for r in requests], requests, release, f"{job}@{step}")

    def hold_relayed(
        self,
        peer_url: str,
        job: str,
        step: int,
        items: Sequence[tuple[str, Box, str]],
        save_id: str | None = None,
    ) -> Held:
        """`hold_boxes` for boxes of another host's store (blob, box, expected dtype): this host's store
        fetches each once (as `fetch_remote_many`), the boxes are verified in its memory and held there,
        so the caller copies them into its tensors later without landing them in scratch memory first."""
        self._check_holdable(items, "read relayed boxes with fetch_remote_many")
        if len(items) > RELAY_BATCH:
            raise BadRequestError(f"at most {RELAY_BATCH} relayed boxes per hold, {len(items)} asked")
        if not items:
            return Held([], lambda: None)
        pin: list[Conn] = []
        payload = self._relay_payload(peer_url, job, step, items, save_id)
        found = self.request("POST", "/v1/relay", payload, hold=pin)
        release = partial(self._unlease, found["lease"], pin)
        try:
            for info, (name, box, _) in zip(found["blobs"], items, strict=True):
                if tuple(info["shape"]) != box.shape:
                    raise StoreError(f"relay of {name!r} answered shape {info['shape']} for box {box}")
        except BaseException:  # nothing is handed out: the lease ends here
            release()
            raise
        whole = [(name, Box.full(box.shape), dtype) for name, box, dtype in items]  # a relay blob is its box
        return self._held(found["blobs"], whole, release, f"relay {peer_url} {job}@{step}")

    def _check_holdable(self, items: Sequence[tuple[str, Box, str]], instead: str) -> None:
        if not self.is_local:
            raise BadRequestError(f"{self.url} is not on this host: {instead}")
        for name, _, dtype in items:
            check_name(name)
            check_dtype(dtype)

    def _held(
        self,
        infos: list[dict[str, Any]],
        items: Sequence[tuple[str, Box, str]],
        release: Callable[[], None],
        where: str,
    ) -> Held:
        """Verified views of (blob, box, dtype) of located blobs, held until `release`; on any error the
        hold ends before it is raised."""
        held = Held([], release)
        try:
            for info, (name, box, dtype) in zip(infos, items, strict=True):
                held.arrays.append(self._verified_view(info, box, dtype, f"{where}/{name}"))
        except BaseException:
            held.close()
            raise
        return held

    def _verified_view(self, info: dict[str, Any], box: Box, dtype: str, what: str) -> np.ndarray:
        """A read-only view of `box` of a located blob, its chunks verified; refuses another dtype (as
        check_out does for a copy: bytes are never reinterpreted)."""
        if info["dtype"] != dtype:
            raise BadRequestError(f"{what} holds {info['dtype']}, {dtype} expected")
        shape = tuple(info["shape"])
        check_inside(box, shape)
        self._check_chunk(info)
        data = self._map(info)
        arr = blob_array(data, dtype, shape)
        lo, hi = byte_span(box, shape, arr.itemsize)
        verify_span(data, info["digests"], lo, hi, what)
        return arr[(*box.slices(), ...)]  # read-only: the mapping is

    def _locate(
        self, job: str, step: int, names: list[str], save_id: str | None
    ) -> tuple[dict[str, dict[str, Any]], Callable[[], None]]:
        """Same host: where the blobs' files are, held by the daemon for this connection until the
        returned function ends the lease."""
        names = sorted(set(names))
        pin: list[Conn] = []  # the connection that holds the lease
        ask = {"names": names, "save_id": save_id}
        found = self.request("POST", f"{self._vpath(job, step)}/locate", ask, hold=pin)
        return dict(zip(names, found["blobs"])), partial(self._unlease, found["lease"], pin)

    @staticmethod
    def _check_chunk(info: dict[str, Any]) -> None:
        if info["chunk"] != CHUNK:
            raise StoreError(f"store uses {info['chunk']}-byte checksum chunks, this client {CHUNK}")

    def _unlease(self, lease: int, pin: list[Conn]) -> None:
        """End a lease on the connection that holds it, without waiting for the answer (a round trip per
        read otherwise); if sending fails the connection is closed, which ends the lease too."""
        for conn in pin:
            self.send_only(conn, "POST", "/v1/release", {"lease": lease})

    def _copy_local(self, info: dict[str, Any], box: Box, out: np.ndarray, what: str) -> None:
        check_inside(box, tuple(info["shape"]))
        dst = check_out(out, info["dtype"], box)
        self._check_chunk(info)
        copy_box(self._map(info), info["digests"], info["dtype"], tuple(info["shape"]), box, dst, what)

    def _map(self, info: dict[str, Any], writable: bool = False) -> memoryview:
        """A blob's bytes in a cached mapping of its file (see `mappings`): a file of its own mapped whole;
        a pack or the store's reserve mapped whole once, unpopulated, and each blob's range populated when
        handed out."""
        path, nbytes, at, span = info["path"], info["nbytes"], info["offset"], info["span"]
        whole = at == 0 and span == nbytes
        mem = self.maps.get((path, span, writable), lambda: map_file(path, span, writable, populate=whole))
        if whole:
            return memoryview(mem)
        if not 0 <= at <= at + nbytes <= span:
            raise StoreError(f"the store placed a blob of {nbytes} bytes at {at} in a file of {span}")
        populate(mem, at, nbytes, writable)
        return memoryview(mem)[at : at + nbytes]

    def fetch_remote(
        self,
        peer_url: str,
        job: str,
        step: int,
        name: str,
        box: Box | None,
        out: np.ndarray,
        save_id: str | None = None,
    ) -> None:
        """Relay: have *this* client's store fetch `box` (None: the whole blob) of a blob held by the store at
        `peer_url` once, cache it, and serve it from there — so ranks of one host that need the same remote
        bytes move them across the network once. The cache lives until the local store's version
        (job, step) is deleted or `drop_relay(job, step)` is called."""
        self.fetch_remote_many(peer_url, job, step, [(name, box, out)], save_id)

    def fetch_remote_many(
        self,
        peer_url: str,
        job: str,
        step: int,
        items: Sequence[tuple[str, Box | None, np.ndarray]],
        save_id: str | None = None,
    ) -> None:
        """`fetch_remote` for many (name, box, out) of one peer's version: one relay request per batch, and
        the store fetches what it lacks of a batch in batched reads over one connection."""
        for name, box, out in items:
            check_name(name)
            if box is not None and tuple(out.shape) != box.shape:
                raise BadRequestError(f"out for {name!r} must have the box's shape {list(box.shape)}")
        for start in range(0, len(items), RELAY_BATCH):
            part = items[start : start + RELAY_BATCH]
            payload = self._relay_payload(peer_url, job, step, part, save_id)
            if not self.is_local:
                self.request("POST", "/v1/relay", payload, reader=into([o for _, _, o in part]))
                continue
            pin: list[Conn] = []
            found = self.request("POST", "/v1/relay", payload, hold=pin)
            try:
                for info, (name, _, out) in zip(found["blobs"], part, strict=True):
                    whole = Box.full(tuple(info["shape"]))
                    self._copy_local(info, whole, out, f"relay {peer_url} {job}@{step}/{name}")
            finally:
                self._unlease(found["lease"], pin)

    def _relay_payload(
        self,
        peer_url: str,
        job: str,
        step: int,
        part: Sequence[tuple[str, Box | None, Any]],
        save_id: str | None,
    ) -> dict[str, Any]:
        return {
            "peer": peer_url, "job": check_job(job), "step": check_step(step), "local": self.is_local,
            "boxes": [{"name": n, "box": None if b is None else b.to_json()} for n, b, _ in part],
            "save_id": save_id,
        }  # fmt: skip

    def drop_relay(self, job: str, step: int, wait: bool = True) -> int | None:
        """Free the relay cache entries of (job, step); returns how many were dropped. `wait=False` sends
        the request without waiting for its answer (None; read by the connection's next user)."""
        payload = {"job": check_job(job), "step": check_step(step)}
        if not wait:
            self.send_only(self._conn(), "POST", "/v1/relay/drop", payload)
            return None
        return self.request("POST", "/v1/relay/drop", payload)["dropped"]


def read_many(
    requests: Iterable[tuple[StoreClient, str, int, str, Box, np.ndarray]],
    concurrency: int = 8,
    save_id: str | None = None,
    sums: dict[int, list[int]] | None = None,
) -> None:
    """Read boxes from many stores in parallel into the callers' arrays (`sums`: see `transport.into`).

    Requests to the same (store, job, version) are batched (up to 256 boxes / 256 MiB per request); at most
    `concurrency` requests are in flight, and since every byte lands in its final array the memory used is
    bounded by the connections' buffers, whatever the total size."""
    batches: dict[tuple[int, str, int], list[list[BoxRequest]]] = {}
    clients: dict[int, StoreClient] = {}
    sizes: dict[tuple[int, str, int], int] = {}
    for client, job, step, name, box, out in requests:
        key = (id(client), job, step)
        clients[id(client)] = client
        groups = batches.setdefault(key, [[]])
        nbytes = int(getattr(out, "nbytes", 0))
        if len(groups[-1]) >= 256 or (groups[-1] and sizes.get(key, 0) + nbytes > 256 << 20):
            groups.append([])
            sizes[key] = 0
        groups[-1].append((name, box, out))
        sizes[key] = sizes.get(key, 0) + nbytes
    work = [(clients[k[0]], k[1], k[2], g) for k, gs in batches.items() for g in gs]
    _all([partial(c.read_boxes, job, step, g, save_id, sums) for c, job, step, g in work], concurrency)


def relay_many(
    requests: Iterable[tuple[StoreClient, str, str, Box | None, np.ndarray]],
    job: str,
    step: int,
    concurrency: int = 8,
    save_id: str | None = None,
) -> None:
    """Relayed reads (client of this host's store, peer URL, blob, box, out): one `fetch_remote_many`
    per (store, peer) and batch, at most `concurrency` in flight."""
    calls = [
        partial(c.fetch_remote_many, peer, job, step, part, save_id)
        for c, peer, part in _relay_batches(requests)
    ]
    _all(calls, concurrency)


def hold_relayed_many(
    requests: Iterable[tuple[StoreClient, str, str, Box, str]],
    job: str,
    step: int,
    concurrency: int = 8,
    save_id: str | None = None,
) -> list[tuple[Held, list[int]]]:
    """`hold_relayed` for (client of this host's store, peer URL, blob, box, dtype), batched as `relay_many`:
    one hold per batch, each with the positions in `requests` of its arrays. On an error every hold made is
    ended before it is raised."""
    numbered = [(c, peer, name, box, (dtype, i)) for i, (c, peer, name, box, dtype) in enumerate(requests)]
    work = _relay_batches(numbered)
    holds: list[tuple[Held, list[int]] | None] = [None] * len(work)

    def one(k: int) -> None:
        c, peer, part = work[k]
        h = c.hold_relayed(peer, job, step, [(n, b, dt) for n, b, (dt, _) in part], save_id)
        holds[k] = (h, [i for _, _, (_, i) in part])

    try:
        _all([partial(one, k) for k in range(len(work))], concurrency)
    except BaseException:
        for made in holds:
            if made is not None:
                made[0].close()
        raise
    return [made for made in holds if made is not None]


def _relay_batches(
    requests: Iterable[tuple[StoreClient, str, str, Any, Any]],
) -> list[tuple[StoreClient, str, list]]:
    """(client, peer, items of at most RELAY_BATCH) per (store, peer), items in request order."""
    groups: dict[tuple[int, str], list[tuple[str, Any, Any]]] = {}
    clients: dict[int, StoreClient] = {}
    for c, peer, name, box, extra in requests:
        clients[id(c)] = c
        groups.setdefault((id(c), peer), []).append((name, box, extra))
    return [(clients[k], peer, items[i : i + RELAY_BATCH])
            for (k, peer), items in groups.items() for i in range(0, len(items), RELAY_BATCH)]  # fmt: skip


def _all(calls: list[Callable[[], None]], concurrency: int) -> None:
    """Run every call, at most `concurrency` at once; then raise the first error (all have ended by then,
    so no call still writes into a caller's array)."""
    if not calls:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(calls)))) as pool:
        futures = [pool.submit(call) for call in calls]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
