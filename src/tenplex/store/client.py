"""`StoreClient`: one interface, two paths — shared memory when the store is on this host, sockets otherwise.

Reads always land in caller-provided arrays (no intermediate `bytes`); connections are pooled and reused;
connection failures are retried with backoff (every request is idempotent); checksums are computed at write
and verified on every read, on whichever side touches the bytes.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import numpy as np

from ..ptc import ITEM_SIZE, Box
from .boxio import as_bytes, copy_box
from .checksum import CHUNK, chunk_digests, chunks, digest
from .datasets import gather, token_windows
from .errors import (
    BadRequestError,
    ChecksumError,
    ConflictError,
    NotFoundError,
    StoreError,
    StoreUnavailable,
    error_from_payload,
)
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
from .protocol import Closed, Conn, connect, content_length, json_body
from .shm import host_id, map_file

DEFAULT_PORT = 7311
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
PREAMBLE = struct.Struct("<Q")  # length of the JSON part description that precedes raw read bodies
MAX_MAPS = 1024  # blob mappings a client keeps open for repeated same-host reads
T = TypeVar("T")

BoxRequest = tuple[str, Box, np.ndarray]  # (blob name, box, out)


def default_url() -> str:
    return os.environ.get("TENPLEX_STORE", DEFAULT_URL)


class StoreClient:
    """Client of one store daemon. Thread-safe: concurrent calls use separate pooled connections."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        local: bool | None = None,
        timeout: float = 120.0,
        retries: int = 3,
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        parts = urlsplit(self.url)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise BadRequestError(f"store URL must look like http://HOST:PORT, got {self.url!r}")
        self.host, self.port = parts.hostname, parts.port or DEFAULT_PORT
        self.token = token if token is not None else os.environ.get("TENPLEX_STORE_TOKEN")
        self.timeout, self.retries = timeout, retries
        self._local = local
        self._pool: list[Conn] = []
        self._lock = threading.Lock()
        self._maps: OrderedDict[tuple[str, int, bool], Any] = OrderedDict()
        self._allocated: dict[tuple[str, int, str], Any] = {}

    def __repr__(self) -> str:
        return f"StoreClient({self.url!r}, local={self._local})"

    # ------------------------------------------------------------------ transport

    def _conn(self) -> Conn:
        with self._lock:
            if self._pool:
                return self._pool.pop()
        return connect(self.host, self.port, self.timeout)

    def _give_back(self, conn: Conn) -> None:
        with self._lock:
            self._pool.append(conn)

    def close(self) -> None:
        """Close pooled connections and cached mappings (the client stays usable)."""
        with self._lock:
            pool, self._pool = self._pool, []
            self._maps.clear()
        for c in pool:
            c.close()

    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        body: Sequence[memoryview] | None = None,
        reader: Callable[[Conn, dict[str, str], int], T] | None = None,
    ) -> Any:
        """One HTTP exchange; retried with backoff when the connection fails (all store requests are
        idempotent). `reader` consumes a 200 response body itself; otherwise the JSON body is returned."""
        data = json_body(payload) if payload is not None else b""
        length = sum(len(b) for b in body) if body is not None else len(data)
        headers = {"Host": f"{self.host}:{self.port}", "Content-Length": str(length)}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        start = f"{method} {path} HTTP/1.1"
        for attempt in range(self.retries + 1):
            conn: Conn | None = None
            try:
                conn = self._conn()
                if body is None:
                    conn.send_head(start, headers, data)
                else:
                    conn.send_head(start, headers)
                    for piece in body:
                        conn.send(piece)
                status, rh = conn.read_head()
                n = content_length(rh)
                if status.split(" ", 2)[1:2] == ["200"] and reader is not None:
                    result = reader(conn, rh, n)
                else:
                    result = conn.read_json(n)
                    code = int(status.split(" ", 2)[1])
                    if code != 200:
                        if rh.get("connection", "").lower() == "close":
                            conn.close()
                        else:
                            self._give_back(conn)
                        conn = None
                        raise error_from_payload(code, result)
                if rh.get("connection", "").lower() == "close":
                    conn.close()
                else:
                    self._give_back(conn)
                return result
            except StoreError as e:
                if conn is not None:
                    conn.close()
                if not isinstance(e, StoreUnavailable) or attempt == self.retries:
                    raise
            except (OSError, Closed, ValueError, IndexError) as e:
                if conn is not None:
                    conn.close()
                if attempt == self.retries:
                    raise StoreUnavailable(f"{self.url}: {method} {path} failed: {e!r}") from e
            time.sleep(0.05 * 4**attempt)
        raise AssertionError("unreachable")

    @staticmethod
    def _vpath(job: str, step: int) -> str:
        return f"/v1/jobs/{check_job(job)}/versions/{check_step(step)}"

    def _bpath(self, job: str, step: int, name: str) -> str:
        return f"{self._vpath(job, step)}/blobs/{quote(check_name(name), safe='')}"

    # ------------------------------------------------------------------ control

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health")

    def stats(self) -> dict[str, Any]:
        return self.request("GET", "/v1/stats")

    @property
    def is_local(self) -> bool:
        """Whether the daemon shares this machine's memory (decided once, from its health answer)."""
        if self._local is None:
            h = self.health()
            self._local = h.get("host_id") == host_id() and os.path.isdir(str(h.get("shm_dir")))
        return self._local

    def jobs(self) -> list[str]:
        return self.request("GET", "/v1/jobs")["jobs"]

    def version_info(self, job: str) -> list[dict[str, Any]]:
        """Every version of `job`, committed or not, with blob counts, sizes and replication state."""
        return self.request("GET", f"/v1/jobs/{check_job(job)}")["versions"]

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

    def latest(self, job: str) -> int | None:
        steps = self.versions(job)
        return steps[-1] if steps else None

    def create_version(self, job: str, step: int) -> None:
        self.request("POST", self._vpath(job, step))

    def commit(
        self,
        job: str,
        step: int,
        manifest: Any,
        wait_replicas: bool = False,
        replica_of: str | None = None,
        blobs: list[str] | None = None,
    ) -> dict[str, Any]:
        """Make version `step` visible with its manifest, atomically; idempotent. With replication on,
        `wait_replicas=True` returns only after the copies are on the peers. `blobs`: the names that make
        the version (each must be sealed); others, left by an abandoned attempt, are dropped."""
        payload = {"manifest": manifest, "wait_replicas": wait_replicas, "replica_of": replica_of}
        if blobs is not None:
            payload["blobs"] = blobs
        return self.request("POST", f"{self._vpath(job, step)}/commit", payload)

    def manifest(self, job: str, step: int) -> Any:
        return self.request("GET", f"{self._vpath(job, step)}/manifest")["manifest"]

    def blobs(self, job: str, step: int) -> list[dict[str, Any]]:
        """Blobs of a committed version: name, dtype, shape, nbytes, copies (URLs of stores holding it)."""
        return self.request("GET", f"{self._vpath(job, step)}/blobs")["blobs"]

    def blob_info(self, job: str, step: int, name: str) -> dict[str, Any]:
        return self.request("GET", self._bpath(job, step, name))

    def delete_version(self, job: str, step: int) -> None:
        self.request("DELETE", self._vpath(job, step))

    def delete_job(self, job: str) -> None:
        self.request("DELETE", f"/v1/jobs/{check_job(job)}")

    def retain(self, job: str, keep: int) -> list[int]:
        """Keep the `keep` newest committed versions of `job`; returns the deleted steps."""
        return self.request("POST", f"/v1/jobs/{check_job(job)}/retain", {"keep": keep})["deleted"]

    def set_peers(self, peers: Sequence[str], replicas: int) -> list[str]:
        """Configure the store's replication ring; returns the peers it will copy committed versions to."""
        return self.request("POST", "/v1/peers", {"peers": list(peers), "replicas": replicas})["targets"]

    # ------------------------------------------------------------------ writing

    def write_blob(self, job: str, step: int, name: str, array: np.ndarray, dtype: str | None = None) -> None:
        """Store `array` (C order) as blob `name` of the uncommitted version `step`; `dtype` names the
        tenplex dtype when numpy has none (bfloat16 passed as a 2-byte integer array)."""
        dt = dtype_name_of(array, dtype)
        src = array if array.flags.c_contiguous else array.copy(order="C")
        if self.is_local:
            dst = self.allocate_blob(job, step, name, dt, src.shape)
            flat_src, flat_dst = as_bytes(src), as_bytes(dst)
            digests = []
            for i in range(0, len(flat_src), CHUNK):  # copy and hash chunk by chunk while it is in cache
                flat_dst[i : i + CHUNK] = flat_src[i : i + CHUNK]
                digests.append(digest(flat_dst[i : i + CHUNK]))
            self._seal(job, step, name, digests)
            return
        pieces = chunks(as_bytes(src))
        self.put_raw(job, step, name, dt, src.shape, pieces, [digest(p) for p in pieces])

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
    ) -> None:
        """Network write of raw C-order bytes in CHUNK-sized pieces; the daemon must hash them as we did.
        `replica_of`: the store this blob is a copy of (replication)."""
        shape_q = ",".join(str(s) for s in shape)
        path = f"{self._bpath(job, step, name)}?dtype={check_dtype(dtype)}&shape={shape_q}"
        if replica_of is not None:
            path += f"&replica_of={quote(replica_of, safe='')}"
        theirs = self.request("PUT", path, body=pieces)["digests"]
        if theirs != digests:
            raise ChecksumError(f"blob {name!r} arrived at {self.url} with different bytes than were sent")

    def allocate_blob(self, job: str, step: int, name: str, dtype: str, shape: Sequence[int]) -> np.ndarray:
        """Same host only: a writable array mapped on the blob's shared memory; fill it, then `seal_blob`."""
        if not self.is_local:
            raise ConflictError(f"allocate_blob needs a store on this host; {self.url} is remote")
        payload = {"dtype": check_dtype(dtype), "shape": list(check_shape(tuple(shape)))}
        info = self.request("POST", f"{self._bpath(job, step, name)}/allocate", payload)
        mem = self._map(info, writable=True)
        arr = np.frombuffer(mem, dtype=NUMPY_DTYPE[dtype]).reshape(tuple(shape))
        with self._lock:
            self._allocated[(job, step, name)] = arr
        return arr

    def seal_blob(self, job: str, step: int, name: str) -> None:
        """Declare an allocated blob fully written: its checksums are taken now."""
        with self._lock:
            arr = self._allocated.get((job, step, name))
        if arr is None:
            raise NotFoundError(f"blob {name!r} was not allocated by this client")
        self._seal(job, step, name, chunk_digests(as_bytes(arr)))

    def _seal(self, job: str, step: int, name: str, digests: list[int]) -> None:
        self.request("POST", f"{self._bpath(job, step, name)}/seal", {"digests": digests})
        with self._lock:
            self._allocated.pop((job, step, name), None)

    # ------------------------------------------------------------------ reading

    def read_box(self, job: str, step: int, name: str, box: Box, out: np.ndarray) -> None:
        """Copy `box` of a committed blob into `out` (C-contiguous, shape == box.shape)."""
        self.read_boxes(job, step, [(name, box, out)])

    def read_boxes(self, job: str, step: int, requests: Sequence[BoxRequest]) -> None:
        """Many boxes of one version in one request (same host: one lookup, then memory copies)."""
        for name, box, out in requests:
            check_name(name)
            if not isinstance(out, np.ndarray) or tuple(out.shape) != box.shape:
                raise BadRequestError(f"out for {name!r} must be an array of shape {list(box.shape)}")
        if not requests:
            return
        if self.is_local:
            names = sorted({r[0] for r in requests})
            infos = self.request("POST", f"{self._vpath(job, step)}/locate", {"names": names})["blobs"]
            by_name = dict(zip(names, infos))
            for name, box, out in requests:
                self._copy_local(by_name[name], box, out, f"{job}@{step}/{name}")
            return
        payload = {"boxes": [{"name": n, "box": b.to_json()} for n, b, _ in requests]}
        self.request(
            "POST", f"{self._vpath(job, step)}/read", payload, reader=_into([r[2] for r in requests])
        )

    def _copy_local(self, info: dict[str, Any], box: Box, out: np.ndarray, what: str) -> None:
        check_inside(box, tuple(info["shape"]))
        dst = check_out(out, info["dtype"], box)
        if info["chunk"] != CHUNK:
            raise StoreError(f"store uses {info['chunk']}-byte checksum chunks, this client {CHUNK}")
        copy_box(self._map(info), info["digests"], info["dtype"], tuple(info["shape"]), box, dst, what)

    def _map(self, info: dict[str, Any], writable: bool = False) -> memoryview:
        """A cached mapping of a blob file: the daemon recycles files of freed blobs for new blobs of the same
        size, so a periodic writer or reader maps each file once (mapping costs about as much as copying)."""
        key = (info["path"], info["nbytes"], writable)
        with self._lock:
            mem = self._maps.get(key)
            if mem is not None:
                self._maps.move_to_end(key)
        if mem is None:
            mem = map_file(info["path"], info["nbytes"], writable=writable)
            with self._lock:
                self._maps[key] = mem
                while len(self._maps) > MAX_MAPS:
                    self._maps.popitem(last=False)
        return memoryview(mem)

    def fetch_remote(
        self, peer_url: str, job: str, step: int, name: str, box: Box | None, out: np.ndarray
    ) -> None:
        """Relay: have *this* client's store fetch `box` (None: the whole blob) of a blob held by the store at
        `peer_url` once, cache it, and serve it from there — so ranks of one host that need the same remote
        bytes move them across the network once. The cache lives until the local store's version
        (job, step) is deleted or `drop_relay(job, step)` is called."""
        payload = {
            "peer": peer_url, "job": check_job(job), "step": check_step(step), "name": check_name(name),
            "box": None if box is None else box.to_json(), "local": self.is_local,
        }  # fmt: skip
        if box is not None and tuple(out.shape) != box.shape:
            raise BadRequestError(f"out must have the box's shape {list(box.shape)}")
        if self.is_local:
            info = self.request("POST", "/v1/relay", payload)
            self._copy_local(
                info, Box.full(tuple(info["shape"])), out, f"relay {peer_url} {job}@{step}/{name}"
            )
        else:
            self.request("POST", "/v1/relay", payload, reader=_into([out]))

    # ------------------------------------------------------------------ dataset views

    def register_dataset(
        self, name: str, corpus_dir: str | os.PathLike, split: str = "train", *, seq: int
    ) -> dict:
        """Have the store map `corpus_dir` (a `build_corpus` directory *on the store's host*; made absolute
        here) read-only under `name`; returns its info (tokens, num_samples, ...). Re-registering replaces."""
        payload = {"corpus_dir": os.path.abspath(os.fspath(corpus_dir)), "split": split, "seq": seq}
        return self.request("POST", f"/v1/datasets/{check_job(name)}", payload)

    def datasets(self) -> list[dict[str, Any]]:
        return self.request("GET", "/v1/datasets")["datasets"]

    def dataset_info(self, name: str) -> dict[str, Any]:
        return self.request("GET", f"/v1/datasets/{check_job(name)}")

    def drop_dataset(self, name: str) -> None:
        self.request("DELETE", f"/v1/datasets/{check_job(name)}")

    def dataset_ids(
        self, name: str, sampler_state: dict[str, int], dp: int, rank: int, steps: int = 1
    ) -> list[np.ndarray]:
        """Rank `rank` of `dp`'s sample ids for the next `steps` global batches from the position in
        `sampler_state` (`ElasticSampler.state_dict()`), as the store's `ElasticSampler` computes them."""
        payload = {"sampler": {k: int(v) for k, v in dict(sampler_state).items()}, "dp": dp, "rank": rank,
                   "steps": steps}  # fmt: skip
        ids = self.request("POST", f"/v1/datasets/{check_job(name)}/ids", payload)["ids"]
        return [np.asarray(step, dtype=np.int64) for step in ids]

    def read_samples(self, name: str, ids: Sequence[int] | np.ndarray, out: np.ndarray) -> None:
        """Token windows `ids` ([n, seq+1], sample i = tokens[i*seq : i*seq+seq+1]) into `out` (C-contiguous,
        the corpus dtype). Same host: gathered straight from this process's read-only map of the corpus file;
        otherwise the store sends the raw bytes."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not isinstance(out, np.ndarray) or out.ndim != 2 or out.shape[0] != len(ids):
            raise BadRequestError(f"out must be an array of shape [{len(ids)}, seq+1]")
        if self.is_local:
            info = self.dataset_info(name)
            check_out(out, info["dtype"], Box.full((len(ids), info["seq"] + 1)))
            if ids.size and (ids.min() < 0 or ids.max() >= info["num_samples"]):
                raise BadRequestError(
                    f"sample ids out of range [0, {info['num_samples']}) of dataset {name!r}"
                )
            win = token_windows(self._corpus_map(info), info["seq"], info["num_samples"])
            gather(win, ids, out.view(NUMPY_DTYPE[info["dtype"]]))
            return
        self.request(
            "POST", f"/v1/datasets/{check_job(name)}/read", {"ids": ids.tolist()}, reader=_into([out])
        )

    def rank_samples(
        self, name: str, sampler_state: dict[str, int], dp: int, rank: int, steps: int = 1
    ) -> list[np.ndarray]:
        """`dataset_ids` then `read_samples`: rank `rank`'s token windows of the next `steps` batches."""
        info = self.dataset_info(name)
        dtype, seq = NUMPY_DTYPE[info["dtype"]], info["seq"]
        out = []
        for ids in self.dataset_ids(name, sampler_state, dp, rank, steps):
            out.append(np.empty((len(ids), seq + 1), dtype=dtype))
            self.read_samples(name, ids, out[-1])
        return out

    def _corpus_map(self, info: dict[str, Any]) -> np.ndarray:
        """A cached read-only map of a corpus token file (corpus directories are immutable once built)."""
        key = (info["path"], info["nbytes"], False)
        with self._lock:
            mem = self._maps.get(key)
        if mem is None:
            if os.path.getsize(info["path"]) != info["nbytes"]:
                raise StoreError(f"{info['path']} changed size since the store registered it")
            mem = np.memmap(info["path"], dtype=NUMPY_DTYPE[info["dtype"]], mode="r", shape=(info["tokens"],))
            with self._lock:
                self._maps[key] = mem
                while len(self._maps) > MAX_MAPS:
                    self._maps.popitem(last=False)
        return mem

    def drop_relay(self, job: str, step: int) -> int:
        """Free the relay cache entries of (job, step); returns how many were dropped."""
        payload = {"job": check_job(job), "step": check_step(step)}
        return self.request("POST", "/v1/relay/drop", payload)["dropped"]


def _into(outs: list[np.ndarray]) -> Callable[[Conn, dict[str, str], int], None]:
    """A response reader that receives the raw parts of a read straight into `outs`."""

    def read(conn: Conn, headers: dict[str, str], length: int) -> None:
        head = bytearray(PREAMBLE.size)
        conn.read_into(memoryview(head))
        (n,) = PREAMBLE.unpack(head)
        meta = json.loads(conn.read_bytes(n))
        left = length - PREAMBLE.size - n
        try:
            views = []
            for part, out in zip(meta["parts"], outs, strict=True):
                dt = part["dtype"]
                if dt not in ITEM_SIZE:
                    raise StoreError(f"store answered with unknown dtype {dt!r}")
                views.append(as_bytes(check_out(out, dt, Box.full(tuple(out.shape)))))
                if len(views[-1]) != part["nbytes"]:
                    raise StoreError(f"store answered {part['nbytes']} bytes for a {len(views[-1])}-byte box")
        except StoreError:
            conn.drain(left)
            raise
        for v in views:
            conn.read_into(v)

    return read


def read_many(
    requests: Iterable[tuple[StoreClient, str, int, str, Box, np.ndarray]], concurrency: int = 8
) -> None:
    """Read boxes from many stores in parallel into the callers' arrays.

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
    if not work:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(work)))) as pool:
        futures = [pool.submit(c.read_boxes, job, step, g) for c, job, step, g in work]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
