"""The tensor store daemon: a threaded HTTP/1.1 server on raw sockets, one thread per connection.

Control requests carry JSON; blob bodies are raw C-order bytes received straight into shared memory and
sent straight from it (contiguous boxes) or through one reusable buffer per connection (strided boxes).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import os
import re
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from ..ptc import Box
from ..util import SizeError, parse_size, read_token
from .boxio import SCRATCH, blob_array, pieces
from .catalog import Blob, Catalog
from .checksum import CHUNK, byte_span, chunk_digests, digest, verify_span
from .client import DEFAULT_PORT, PREAMBLE
from .datasets import Dataset, Registry, check_ids, gather, open_dataset, rank_view
from .errors import (
    AuthError,
    BadRequestError,
    NotFoundError,
    StoreError,
    TooLargeError,
)
from .keys import check_box, check_dtype, check_job, check_name, check_shape, check_step
from .protocol import REASONS, Closed, Conn, content_length, json_body
from .relay import RelayCache
from .replication import Replicator
from .shm import Arena, host_id

MAX_BOXES = 4096  # boxes in one read request
MAX_BLOBS_PER_COMMIT = 1 << 20  # names a commit may list
MAX_CONNECTIONS = 1024
IDLE_TIMEOUT = 300.0  # seconds a connection may stay silent (also bounds a stalled body)
PROTOCOL_VERSION = 1


class _Shutdown(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT to leave the accept loop."""


@dataclass
class Request:
    conn: Conn
    method: str
    params: dict[str, str]
    query: dict[str, list[str]]
    headers: dict[str, str]
    length: int
    consumed: bool = False
    scratch: list[np.ndarray] = field(default_factory=list)  # the connection's reusable buffer

    def json(self) -> dict[str, Any]:
        self.consumed = True
        body = self.conn.read_json(self.length) if self.length else {}
        if not isinstance(body, dict):
            raise BadRequestError("the JSON body must be an object")
        return body

    def job(self) -> str:
        return check_job(self.params["job"])

    def step(self) -> int:
        return check_step(self.params["step"])

    def name(self) -> str:
        try:
            return check_name(unquote(self.params["name"], errors="strict"))
        except UnicodeDecodeError:
            raise BadRequestError("blob name is not UTF-8") from None


Handler = Callable[["Daemon", Request], Any]
ROUTES: list[tuple[str, re.Pattern[str], Handler]] = []
_V = r"/v1/jobs/(?P<job>[^/]+)/versions/(?P<step>[^/]+)"


def route(method: str, pattern: str) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        ROUTES.append((method, re.compile(pattern + "$"), fn))
        return fn

    return deco


class Daemon:
    """State and request handlers of one store; `serve_forever` runs the accept loop."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        memory_limit: int = 16 << 30,
        token: str | None = None,
        peers: list[str] | None = None,
        replicas: int = 0,
        advertise: str | None = None,
        shm_root: str | None = None,
    ) -> None:
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=512)
        self.port = self.sock.getsockname()[1]
        shown = host if host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.url = advertise or f"http://{_bracket(shown)}:{self.port}"
        self.token = token
        self.arena = Arena(str(self.port), shm_root)
        self.catalog = Catalog(self.arena, min(memory_limit, self.arena.capacity()))
        self.replicator = Replicator(self, peers or [], replicas)
        self.relay = RelayCache(self)
        self.datasets = Registry()
        self.counters = {"requests": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0}
        self.conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ serving

    def serve_forever(self) -> None:
        while True:
            client, _ = self.sock.accept()
            with self._lock:
                full = len(self.conns) >= MAX_CONNECTIONS
                if not full:
                    self.conns.add(client)
            if full:
                _reject(client)
                continue
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def close(self) -> None:
        """Stop serving and release every blob file and the shared-memory directory."""
        self.sock.close()
        with self._lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.catalog.close()
        self.relay.close()
        self.arena.close()

    def _connection(self, sock: socket.socket) -> None:
        sock.settimeout(IDLE_TIMEOUT)
        conn = Conn(sock)
        scratch: list[np.ndarray] = []
        try:
            while self._one(conn, scratch):
                pass
        except (OSError, Closed):
            pass
        finally:
            with self._lock:
                self.conns.discard(sock)
            conn.close()

    def _one(self, conn: Conn, scratch: list[np.ndarray]) -> bool:
        """Serve one request; False when the connection must close."""
        try:
            start, headers = conn.read_head()
        except Closed:
            return False
        except StoreError as e:  # unparseable head: framing is lost, answer and close
            self._count("errors")
            _send_error(conn, e, close=True)
            return False
        self._count("requests")
        req: Request | None = None
        try:
            req = self._parse(conn, start, headers, scratch)
            handler = self._find(req, start)
            result = handler(self, req)
            if result is not None:
                if not req.consumed and req.length:
                    raise BadRequestError("this request takes no body")
                body = json_body(result)
                conn.send_head("HTTP/1.1 200 OK", _headers(len(body)), body)
        except StoreError as e:
            self._count("errors")
            # the body may still be on the wire: skip a small one, otherwise close after answering
            close = req is None or (not req.consumed and req.length > (1 << 20))
            if req is not None and not req.consumed and not close:
                try:
                    conn.drain(req.length)
                except StoreError:
                    close = True
            if req is not None and req.consumed and getattr(e, "mid_body", False):
                close = True
            _send_error(conn, e, close=close)
            return not close
        except (OSError, Closed):
            raise
        except Exception as e:  # a bug must not take the daemon down: report it and drop the connection
            self._count("errors")
            traceback.print_exc(file=sys.stderr)
            _send_error(conn, StoreError(f"internal error: {type(e).__name__}: {e}"), close=True)
            return False
        return headers.get("connection", "").lower() != "close"

    def _parse(self, conn: Conn, start: str, headers: dict[str, str], scratch: list[np.ndarray]) -> Request:
        parts = start.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequestError(f"malformed request line {start[:80]!r}")
        length = content_length(headers)
        if self.token is not None:  # checked before anything else; the connection is closed on failure
            auth = headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.token}".encode()):
                raise AuthError("missing or wrong bearer token")
        split = urlsplit(parts[1])
        return Request(
            conn, parts[0], {"_path": split.path}, parse_qs(split.query), headers, length, False, scratch
        )

    def _find(self, req: Request, start: str) -> Handler:
        path = req.params.pop("_path")
        allowed = False
        for method, pattern, fn in ROUTES:
            m = pattern.match(path)
            if m:
                allowed = True
                if method == req.method:
                    req.params.update(m.groupdict())
                    return fn
        if allowed:
            raise BadRequestError(f"method {req.method} not allowed on {path[:200]}")
        raise NotFoundError(f"no such endpoint: {start[:200]}")

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    # ------------------------------------------------------------------ bulk helpers

    def send_parts(self, req: Request, parts: list[tuple[Blob, Box]], what: str) -> None:
        """Verify every touched chunk first (so corruption is a clean JSON error), then stream the boxes."""
        for blob, box in parts:
            lo, hi = byte_span(box, blob.shape, blob.itemsize)
            verify_span(memoryview(blob.mem), blob.digests, lo, hi, f"{what} {blob.name!r}")
        sizes = [box.volume * blob.itemsize for blob, box in parts]
        meta = json_body({"parts": [{"dtype": b.dtype, "nbytes": n} for (b, _), n in zip(parts, sizes)]})
        total = PREAMBLE.size + len(meta) + sum(sizes)
        head = PREAMBLE.pack(len(meta)) + meta
        req.conn.send_head("HTTP/1.1 200 OK", _headers(total, "application/octet-stream"), head)
        if not req.scratch:
            req.scratch.append(np.empty(SCRATCH, dtype=np.uint8))
        for blob, box in parts:
            view = blob_array(memoryview(blob.mem), blob.dtype, blob.shape)[box.slices()]
            for piece in pieces(view, req.scratch[0]):
                req.conn.send(piece)
        self._count("bytes_out", total)

    def receive_blob(self, req: Request, name: str, dtype: str, shape: tuple[int, ...]) -> Blob:
        """Receive a raw body into a new blob's shared memory, hashing each chunk as it arrives."""
        blob = self.catalog.new_blob(name, dtype, shape)
        if req.length != blob.nbytes:
            self.catalog.drop(blob)
            raise BadRequestError(f"body has {req.length} bytes, {dtype}{list(shape)} needs {blob.nbytes}")
        req.consumed = True
        data = memoryview(blob.mem)
        try:
            for i in range(0, blob.nbytes, CHUNK):
                req.conn.read_into(data[i : i + CHUNK])
                blob.digests.append(digest(data[i : i + CHUNK]))
        except BaseException as e:
            self.catalog.drop(blob)
            if isinstance(e, StoreError):
                e.mid_body = True  # type: ignore[attr-defined]
            raise
        finally:
            data.release()
        blob.sealed = True
        self._count("bytes_in", blob.nbytes)
        return blob


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _headers(length: int, ctype: str = "application/json") -> dict[str, str]:
    return {"Content-Type": ctype, "Content-Length": str(length)}


def _send_error(conn: Conn, e: StoreError, close: bool) -> None:
    body = json_body({"error": e.kind, "message": str(e)})
    headers = _headers(len(body))
    if close:
        headers["Connection"] = "close"
    try:
        conn.send_head(f"HTTP/1.1 {e.status} {REASONS.get(e.status, 'Error')}", headers, body)
    except OSError:
        pass


def _reject(sock: socket.socket) -> None:
    try:
        _send_error(Conn(sock), StoreError("too many connections"), close=True)
    finally:
        sock.close()


# ------------------------------------------------------------------ handlers (the README's store section)


@route("GET", r"/v1/health")
def _health(d: Daemon, req: Request) -> dict[str, Any]:
    """Liveness, protocol version, this store's URL, pid, host id and replication targets."""
    return {"ok": True, "protocol": PROTOCOL_VERSION, "url": d.url, "pid": os.getpid(), "host_id": host_id(),
            "shm_dir": d.arena.dir, "replicas": list(d.replicator.targets)}  # fmt: skip


@route("GET", r"/v1/openapi.json")
def _openapi(d: Daemon, req: Request) -> dict[str, Any]:
    """This API as an OpenAPI 3.1 document."""
    from .openapi import document

    return document(ROUTES, PROTOCOL_VERSION)


@route("GET", r"/v1/stats")
def _stats(d: Daemon, req: Request) -> dict[str, Any]:
    """Memory, jobs, versions, blobs, datasets, requests, errors, bytes in and out, connections, RSS."""
    c = d.catalog
    with c.lock:
        versions = [v for vs in c.jobs.values() for v in vs.values()]
        out = {"memory_used": c.used, "memory_limit": c.limit, "memory_pooled": d.arena.pooled,
 "jobs": len(c.jobs), "versions": len(versions),
               "committed": sum(v.committed for v in versions), "blobs": sum(len(v.blobs) for v in versions),
               "relay_blobs": len(d.relay.blobs), "datasets": len(d.datasets.items)}  # fmt: skip
    with d._lock:
        out.update(d.counters, connections=len(d.conns))
    out["rss"] = _rss()
    return out


@route("GET", r"/v1/jobs")
def _jobs(d: Daemon, req: Request) -> dict[str, Any]:
    """The jobs this store holds."""
    with d.catalog.lock:
        return {"jobs": sorted(d.catalog.jobs)}


@route("GET", r"/v1/jobs/(?P<job>[^/]+)")
def _job(d: Daemon, req: Request) -> dict[str, Any]:
    """One job's versions."""
    job = req.job()
    with d.catalog.lock:
        versions = d.catalog.jobs.get(job)
        if versions is None:
            raise NotFoundError(f"unknown job {job!r}")
        return {"job": job, "versions": [versions[s].info() for s in sorted(versions)]}


@route("DELETE", r"/v1/jobs/(?P<job>[^/]+)")
def _delete_job(d: Daemon, req: Request) -> dict[str, Any]:
    """Delete a job with all its versions."""
    job = req.job()
    dropped = d.relay.drop(job, None)
    try:
        d.catalog.delete_job(job)
    except NotFoundError:
        if not dropped:
            raise
    return {"deleted": job}


@route("POST", r"/v1/jobs/(?P<job>[^/]+)/retain")
def _retain(d: Daemon, req: Request) -> dict[str, Any]:
    """Keep the newest `keep` committed versions of a job, delete the rest."""
    job, body = req.job(), req.json()
    deleted = d.catalog.retain(job, body.get("keep"))
    for s in deleted:
        d.relay.drop(job, s)
    return {"deleted": deleted}


@route("POST", _V)
def _create(d: Daemon, req: Request) -> dict[str, Any]:
    """Create an uncommitted version (idempotent)."""
    v = d.catalog.create_version(req.job(), req.step())
    return v.info()


@route("DELETE", _V)
def _delete(d: Daemon, req: Request) -> dict[str, Any]:
    """Delete a version."""
    job, step = req.job(), req.step()
    dropped = d.relay.drop(job, step)
    try:
        d.catalog.delete_version(job, step)
    except NotFoundError:
        if not dropped:
            raise
    return {"deleted": step}


@route("POST", _V + r"/commit")
def _commit(d: Daemon, req: Request) -> dict[str, Any]:
    """Commit a version with its manifest, atomically (optionally naming the blobs that make it)."""
    job, step, body = req.job(), req.step(), req.json()
    replica_of = body.get("replica_of")
    if replica_of is not None and not isinstance(replica_of, str):
        raise BadRequestError("replica_of must be a URL")
    blobs = body.get("blobs")
    if blobs is not None:
        if not isinstance(blobs, list) or len(blobs) > MAX_BLOBS_PER_COMMIT:
            raise BadRequestError(f"blobs must be a list of at most {MAX_BLOBS_PER_COMMIT} names")
        blobs = [check_name(n) for n in blobs]
    v, new = d.catalog.commit(job, step, body.get("manifest"), replica_of, blobs)
    if new:
        with d.catalog.lock:
            for b in v.blobs.values():
                if b.origin is None:  # a replica's copies were set when it arrived
                    b.copies = [d.url]
    if new and replica_of is None:
        d.replicator.start(job, step, v)
    if body.get("wait_replicas"):
        d.replicator.wait(job, step)
    return v.info()


@route("GET", _V + r"/manifest")
def _manifest(d: Daemon, req: Request) -> dict[str, Any]:
    """The manifest of a committed version."""
    with d.catalog.lock:
        v = d.catalog.version(req.job(), req.step(), committed=True)
        return {"manifest": v.manifest, "replica_of": v.replica_of}


@route("GET", _V + r"/blobs")
def _blobs(d: Daemon, req: Request) -> dict[str, Any]:
    """The blobs of a committed version: name, dtype, shape, size, copies."""
    with d.catalog.lock:
        v = d.catalog.version(req.job(), req.step(), committed=True)
        return {"blobs": [v.blobs[n].info() for n in sorted(v.blobs)]}


@route("GET", _V + r"/blobs/(?P<name>[^/]+)")
def _blob(d: Daemon, req: Request) -> dict[str, Any]:
    """One blob's metadata."""
    return d.catalog.blob(req.job(), req.step(), req.name()).info()


@route("PUT", _V + r"/blobs/(?P<name>[^/]+)")
def _put(d: Daemon, req: Request) -> dict[str, Any]:
    """Write a blob: raw C-order bytes, checksummed as they arrive."""
    job, step, name = req.job(), req.step(), req.name()
    try:
        dtype = check_dtype(req.query["dtype"][0])
        raw = req.query["shape"][0] if "shape" in req.query else ""
        shape = check_shape(tuple(int(x) for x in raw.split(",")) if raw else ())
    except (KeyError, ValueError):
        raise BadRequestError("PUT needs ?dtype=NAME&shape=D0,D1,... (empty shape for a scalar)") from None
    origin = req.query.get("replica_of", [None])[0]  # a peer's copy (replication)
    if origin is None:
        d.catalog.writable(job, step)
    blob = d.receive_blob(req, name, dtype, shape)
    if origin is not None:
        blob.origin, blob.copies = origin, [origin, d.url]
    d.catalog.put(job, step, blob)
    return {"name": name, "nbytes": blob.nbytes, "digests": blob.digests}


@route("POST", _V + r"/blobs/(?P<name>[^/]+)/allocate")
def _allocate(d: Daemon, req: Request) -> dict[str, Any]:
    """Allocate a blob in shared memory for a writer on this host."""
    job, step, name, body = req.job(), req.step(), req.name(), req.json()
    dtype, shape = check_dtype(body.get("dtype")), check_shape(body.get("shape"))
    d.catalog.writable(job, step)
    blob = d.catalog.new_blob(name, dtype, shape)
    d.catalog.put(job, step, blob)
    return {"path": blob.path, "nbytes": blob.nbytes}


@route("POST", _V + r"/blobs/(?P<name>[^/]+)/seal")
def _seal(d: Daemon, req: Request) -> dict[str, Any]:
    """Declare an allocated blob written; its checksums are taken or given."""
    job, step, name, body = req.job(), req.step(), req.name(), req.json()
    blob = d.catalog.pending_blob(job, step, name)
    digests = body.get("digests")
    n_chunks = -(-blob.nbytes // CHUNK)
    if digests is None:  # the writer did not hash: do it here
        digests = chunk_digests(memoryview(blob.mem))
    elif not (isinstance(digests, list) and len(digests) == n_chunks
              and all(type(x) is int and 0 <= x < 2**64 for x in digests)):  # fmt: skip
        raise BadRequestError(f"digests must be {n_chunks} unsigned 64-bit integers")
    with d.catalog.lock:
        blob.digests, blob.sealed = digests, True
    return {"name": name, "nbytes": blob.nbytes}


def _boxes(d: Daemon, job: str, step: int, body: dict[str, Any]) -> list[tuple[Blob, Box]]:
    items = body.get("boxes")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise BadRequestError('expected {"boxes": [{"name": ..., "box": [[start, stop], ...]}, ...]}')
    if len(items) > MAX_BOXES:
        raise TooLargeError(f"{len(items)} boxes in one request; at most {MAX_BOXES}")
    out = []
    for item in items:
        blob = d.catalog.blob(job, step, check_name(item.get("name")))
        out.append((blob, check_box(item.get("box"), blob.shape)))
    return out


@route("POST", _V + r"/read")
def _read(d: Daemon, req: Request) -> None:
    """Read many boxes of a version's blobs: a JSON preamble, then the raw bytes of each box."""
    job, step = req.job(), req.step()
    d.send_parts(req, _boxes(d, job, step, req.json()), f"{job}@{step}")


@route("POST", _V + r"/locate")
def _locate(d: Daemon, req: Request) -> dict[str, Any]:
    """Where a version's blobs live in shared memory, with their checksums (same-host readers)."""
    job, step, body = req.job(), req.step(), req.json()
    names = body.get("names")
    if not isinstance(names, list) or len(names) > MAX_BOXES:
        raise BadRequestError(f'expected {{"names": [...]}} with at most {MAX_BOXES} names')
    return {"blobs": [d.catalog.blob(job, step, check_name(n)).info(local=True) for n in names]}


@route("POST", r"/v1/relay")
def _relay(d: Daemon, req: Request) -> dict[str, Any] | None:
    """Fetch a box from a remote store once and serve it to this host's ranks."""
    body = req.json()
    blob = d.relay.get(body)
    if body.get("local"):
        return blob.info(local=True)
    d.send_parts(req, [(blob, Box.full(blob.shape))], "relay")
    return None


@route("POST", r"/v1/relay/drop")
def _relay_drop(d: Daemon, req: Request) -> dict[str, Any]:
    """Free a job's relayed boxes."""
    body = req.json()
    return {"dropped": d.relay.drop(check_job(body.get("job")), check_step(body.get("step")))}


@route("POST", r"/v1/peers")
def _peers(d: Daemon, req: Request) -> dict[str, Any]:
    """Set the replication ring after start (stores on free ports learn each other's URLs late)."""
    body = req.json()
    peers, replicas = body.get("peers"), body.get("replicas")
    if not (isinstance(peers, list) and all(isinstance(p, str) for p in peers) and type(replicas) is int
            and replicas >= 0 and len(peers) <= 4096):  # fmt: skip
        raise BadRequestError('expected {"peers": [URL, ...], "replicas": R}')
    d.replicator.configure([p.rstrip("/") for p in peers], replicas)
    return {"peers": d.replicator.peers, "targets": d.replicator.targets}


@route("GET", r"/v1/datasets")
def _datasets(d: Daemon, req: Request) -> dict[str, Any]:
    """The registered datasets."""
    return {"datasets": d.datasets.list()}


@route("POST", r"/v1/datasets/(?P<job>[^/]+)")
def _register_dataset(d: Daemon, req: Request) -> dict[str, Any]:
    """Map a corpus split read-only under a name (validated in `open_dataset`; see its trust model)."""
    name, body = req.job(), req.json()
    ds = open_dataset(name, body.get("corpus_dir"), body.get("split", "train"), body.get("seq"))
    d.datasets.add(ds)
    return ds.info()


@route("GET", r"/v1/datasets/(?P<job>[^/]+)")
def _dataset(d: Daemon, req: Request) -> dict[str, Any]:
    """One dataset's description."""
    return d.datasets.get(req.job()).info()


@route("DELETE", r"/v1/datasets/(?P<job>[^/]+)")
def _drop_dataset(d: Daemon, req: Request) -> dict[str, Any]:
    """Unregister a dataset."""
    name = req.job()
    d.datasets.drop(name)
    return {"deleted": name}


@route("POST", r"/v1/datasets/(?P<job>[^/]+)/ids")
def _dataset_ids(d: Daemon, req: Request) -> dict[str, Any]:
    """The sample ids a data-parallel rank reads next."""
    ds, body = d.datasets.get(req.job()), req.json()
    return rank_view(ds, body.get("sampler"), body.get("dp"), body.get("rank"), body.get("steps", 1))


@route("POST", r"/v1/datasets/(?P<job>[^/]+)/read")
def _dataset_read(d: Daemon, req: Request) -> None:
    """Read samples of a dataset: a JSON preamble, then raw token windows."""
    ds, body = d.datasets.get(req.job()), req.json()
    send_samples(d, req, ds, check_ids(ds, body.get("ids")))


def send_samples(d: Daemon, req: Request, ds: Dataset, ids: np.ndarray) -> None:
    """Raw answer of the windows `ids`, gathered from the memory map in scratch-sized blocks."""
    win = ds.windows()
    row = win.shape[1] * win.itemsize
    meta = json_body({"parts": [{"dtype": ds.dtype, "nbytes": len(ids) * row}]})
    total = PREAMBLE.size + len(meta) + len(ids) * row
    req.conn.send_head(
        "HTTP/1.1 200 OK", _headers(total, "application/octet-stream"), PREAMBLE.pack(len(meta)) + meta
    )
    if not req.scratch:
        req.scratch.append(np.empty(SCRATCH, dtype=np.uint8))
    flat = req.scratch[0]
    if row > flat.nbytes:  # a window larger than the buffer is contiguous in the map: send it from there
        for i in ids:
            req.conn.send(memoryview(np.ascontiguousarray(win[i]).reshape(-1).view(np.uint8)))
    else:
        k = flat.nbytes // row
        for i in range(0, len(ids), k):
            part = ids[i : i + k]
            dst = flat[: len(part) * row].view(win.dtype).reshape(len(part), win.shape[1])
            gather(win, part, dst)
            req.conn.send(memoryview(flat[: len(part) * row]))
    d._count("bytes_out", total)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------------- process entry point


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_token(path: str | None, required: bool) -> str | None:
    """The bearer token from `path` (or the per-user file when one is required); created 0600 if missing."""
    if path is None and not required:
        return None
    try:
        return read_token(path, create=True)
    except ValueError as e:
        raise BadRequestError(str(e)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except SizeError as e:
        raise BadRequestError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 = any free)"
    )
    p.add_argument("--memory-limit", default="16GiB", help="most blob bytes held (default 16GiB)")
    p.add_argument("--token-file", default=None,
                   help="bearer token file (required off loopback; generated 0600 if missing)")  # fmt: skip
    p.add_argument("--peers", default="", help="comma-separated store URLs of the replication ring")
    p.add_argument("--replicas", type=int, default=0, help="copies of each committed blob on the next peers")
    p.add_argument("--advertise", default=None, help="this store's URL as peers know it")


def run(args: argparse.Namespace) -> int:
    """Start a daemon from parsed arguments, print the ready line, serve until SIGTERM/SIGINT."""
    if not 0 <= args.port < 65536 or args.replicas < 0:
        raise BadRequestError("port must be 0..65535 and replicas >= 0")
    token = load_token(args.token_file, required=not is_loopback(args.host))
    peers = [p.strip().rstrip("/") for p in args.peers.split(",") if p.strip()]
    d = Daemon(args.host, args.port, _size(args.memory_limit), token, peers, args.replicas, args.advertise)

    def stop(signum: int, frame: object) -> None:
        raise _Shutdown

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        print(f"tenplex store listening on {d.url} (pid {os.getpid()})", flush=True)
        d.serve_forever()
    except _Shutdown:
        pass
    finally:
        d.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tenplex.store", description="The tenplex tensor store daemon."
    )
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except StoreError as e:
        print(f"tenplex store: error: {e}", file=sys.stderr)
        return 2
