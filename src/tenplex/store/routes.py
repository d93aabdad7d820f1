"""The store's HTTP API: one handler per route, each taking the `Daemon` and the `Request`.

`ROUTES` is the table the server dispatches on and the OpenAPI document (`GET /v1/openapi.json`) is
generated from; the dataset routes come from `dataset_routes`.
"""

from __future__ import annotations

import os
from typing import Any

from ..ptc import Box
from .auth import Challenge, check_nonce, is_own_url
from .catalog import ANY, Blob, check_save_id
from .checksum import CHUNK, chunk_digests, list_digest
from .daemon import Daemon
from .dataset_routes import DATASET_ROUTES
from .errors import AuthError, BadRequestError, ChecksumError, NotFoundError, TooLargeError
from .keys import check_box, check_dtype, check_job, check_name, check_shape, check_step
from .request import Request, RouteTable
from .shm import host_id

MAX_BOXES = 4096  # boxes in one read request
MAX_BLOBS_PER_COMMIT = 1 << 20  # names a commit may list
PROTOCOL_VERSION = 1

_table = RouteTable()
route = _table.route
_V = r"/v1/jobs/(?P<job>[^/]+)/versions/(?P<step>[^/]+)"


@route("GET", r"/v1/health")
def _health(d: Daemon, req: Request) -> dict[str, Any]:
    """Liveness, protocol version, this store's URL, pid, incarnation, host id and replication targets."""
    return {"ok": True, "protocol": PROTOCOL_VERSION, "url": d.url, "pid": os.getpid(), "host_id": host_id(),
            "incarnation": d.incarnation,
            "shm_dir": d.arena.dir, "unix": d.unix_path, "huge_pages": d.arena.memory.huge,
            "replicas": list(d.replicator.targets)}  # fmt: skip


@route("GET", r"/v1/local", public=True)
def _local(d: Daemon, req: Request) -> dict[str, Any]:
    """Where a client on this host finds this store (answered without the token: the blob directory and
    the Unix socket are this user's alone, and the socket checks its peers' uid)."""
    return {"host_id": host_id(), "shm_dir": d.arena.dir, "unix": d.unix_path}


@route("GET", r"/v1/openapi.json")
def _openapi(d: Daemon, req: Request) -> dict[str, Any]:
    """This API as an OpenAPI 3.1 document."""
    from .openapi import document

    return document(d.routes, PROTOCOL_VERSION)


@route("GET", r"/v1/stats")
def _stats(d: Daemon, req: Request) -> dict[str, Any]:
    """Memory, jobs, versions, blobs, datasets, requests, errors, bytes in and out, connections, RSS."""
    out: dict[str, Any] = d.catalog.stats()
    out.update(memory_pooled=d.arena.pooled, memory_reserved=d.arena.reserve.left,
               relay_blobs=len(d.relay.blobs), datasets=len(d.datasets.items))  # fmt: skip
    out.update(d.connection_stats())
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
    return {"job": job, "versions": d.catalog.listing(job)}


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
    """Keep the `keep` newest committed saves of a job by commit order, and always the `protect`ed one
    ([step, save_id]: the save just committed on every store); with `replica_of`, the copies that store
    pushed here. A store's own retain reaches the copies of its saves on its replication targets."""
    job, body = req.job(), req.json()
    keep, protect, origin = body.get("keep"), _protect(body.get("protect")), _origin(body.get("replica_of"))
    if origin is not None:
        return {"deleted": d.catalog.retain(job, keep, protect, origin)}
    try:
        deleted = d.catalog.retain(job, keep, protect)
    except NotFoundError:  # no own save of the job here: its copies on the targets may still be
        deleted = []
    for s in deleted:
        d.relay.drop(job, s)
    return {"deleted": deleted, "replicas": d.replicator.retain(job, keep, protect)}


@route("POST", _V)
def _create(d: Daemon, req: Request) -> dict[str, Any]:
    """Create an uncommitted version for a save (idempotent); a peer's copy with `replica_of`."""
    job, step, body = req.job(), req.step(), req.json()
    v = d.catalog.create_version(job, step, _save_id(body.get("save_id")), _origin(body.get("replica_of")))
    return v.info()


@route("DELETE", _V)
def _delete(d: Daemon, req: Request) -> dict[str, Any]:
    """Delete a version; with `?replica_of=URL&save_id=S`, only that store's copy of save S here (a push
    that failed or was cancelled), which is never recreated afterwards; with `?save_id=S` alone, only this
    store's open version of save S (a save that failed)."""
    job, step = req.job(), req.step()
    origin = _origin(req.query.get("replica_of", [None])[0])
    if origin is not None:
        save_id = _query_save(req, None)
        if save_id is None:
            raise BadRequestError("deleting a copy needs ?save_id=")
        return {"deleted": step if d.catalog.delete_copy(job, step, origin, save_id) else None}
    save_id = _query_save(req, None)
    if save_id is not None:  # a failed save's open version only: the step's committed save stays
        return {"deleted": step if d.catalog.delete_open(job, step, save_id) else None}
    d.replicator.cancel(job, step)
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
    replica_of, save_id = _origin(body.get("replica_of")), _save_id(body.get("save_id"))
    wait = body.get("wait_replicas")
    if not (wait is None or isinstance(wait, bool) or (type(wait) in (int, float) and 0 <= wait <= 3600)):
        raise BadRequestError("wait_replicas must be a boolean or seconds (0..3600)")
    blobs = body.get("blobs")
    if blobs is not None:
        if not isinstance(blobs, list) or len(blobs) > MAX_BLOBS_PER_COMMIT:
            raise BadRequestError(f"blobs must be a list of at most {MAX_BLOBS_PER_COMMIT} names")
        blobs = [check_name(n) for n in blobs]
    v, new = d.catalog.commit(job, step, body.get("manifest"), replica_of, blobs, save_id)
    if new and replica_of is None:
        with d.catalog.lock:
            for b in v.blobs.values():
                b.copies = [d.url]
        d.replicator.start(job, step, v)
    if wait and replica_of is None:  # bounded: a client asks again rather than time out (and retry)
        d.replicator.wait(job, step, None if wait is True else float(wait))
    return v.info()


@route("GET", _V + r"/manifest")
def _manifest(d: Daemon, req: Request) -> dict[str, Any]:
    """The manifest of a committed version (of the save `?save_id=`, default the one shown)."""
    v = d.catalog.readable(req.job(), req.step(), _query_save(req))[0]
    return {"manifest": v.manifest, "replica_of": v.replica_of, "save_id": v.save_id}


@route("GET", _V + r"/blobs")
def _blobs(d: Daemon, req: Request) -> dict[str, Any]:
    """The blobs of a committed version (of the save `?save_id=`): name, dtype, shape, size, copies."""
    with d.catalog.lock:
        found: dict[str, Blob] = {}
        for v in d.catalog.readable(req.job(), req.step(), _query_save(req)):
            for n, b in v.blobs.items():
                found.setdefault(n, b)  # own blobs first
        return {"blobs": [found[n].info() for n in sorted(found)]}


@route("GET", _V + r"/blobs/(?P<name>[^/]+)")
def _blob(d: Daemon, req: Request) -> dict[str, Any]:
    """One blob's metadata (of the save `?save_id=`)."""
    return d.catalog.blob(req.job(), req.step(), req.name(), _query_save(req)).info()


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
    origin = _origin(req.query.get("replica_of", [None])[0])  # a peer's copy (replication)
    expected = req.query.get("digest", [None])[0]  # of the chunk digests: the sender's bytes
    if origin is not None and expected is None:
        raise BadRequestError("a replica PUT needs ?digest= (its sender's checksum list digest)")
    v = d.catalog.writable(job, step, _query_save(req, None), origin)
    blob = d.receive_blob(req, name, dtype, shape)
    if expected is not None and expected != f"{list_digest(blob.digests):016x}":
        d.catalog.drop(blob)  # a copy that differs from what was sent is never inserted, never served
        raise ChecksumError(f"blob {name!r} arrived with other bytes than its sender checksummed")
    if origin is not None:
        blob.origin, blob.copies = origin, [origin, d.url]
    d.catalog.put(v, blob)
    return {"name": name, "nbytes": blob.nbytes, "digests": blob.digests}


@route("POST", _V + r"/blobs/(?P<name>[^/]+)/allocate")
def _allocate(d: Daemon, req: Request) -> dict[str, Any]:
    """Allocate a blob in shared memory for a writer on this host."""
    job, step, name, body = req.job(), req.step(), req.name(), req.json()
    dtype, shape = check_dtype(body.get("dtype")), check_shape(body.get("shape"))
    v = d.catalog.writable(job, step, _save_id(body.get("save_id")))
    blob = d.catalog.new_blob(name, dtype, shape)
    blob.mapped = True  # the writer maps it: dropped unsealed, its memory is never reused
    d.catalog.put(v, blob)
    return blob.where()


@route("POST", _V + r"/blobs/(?P<name>[^/]+)/seal")
def _seal(d: Daemon, req: Request) -> dict[str, Any]:
    """Declare an allocated blob written; its checksums are taken or given."""
    job, step, name, body = req.job(), req.step(), req.name(), req.json()
    blob = d.catalog.pending_blob(job, step, name, _save_id(body.get("save_id")))
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


@route("POST", _V + r"/allocate")
def _allocate_many(d: Daemon, req: Request) -> dict[str, Any]:
    """Allocate many blobs in shared memory in one request (a rank's whole snapshot: one round trip, not
    one per tensor); all or none."""
    job, step, body = req.job(), req.step(), req.json()
    items = _batch(body, '"name", "dtype", "shape"')
    specs = [(check_name(i.get("name")), check_dtype(i.get("dtype")), check_shape(i.get("shape")))
             for i in items]  # fmt: skip
    if len({n for n, _, _ in specs}) != len(specs):
        raise BadRequestError("a blob is named twice")
    v = d.catalog.writable(job, step, _save_id(body.get("save_id")))
    made: list[Blob] = []
    try:
        for name, dtype, shape in specs:
            made.append(d.catalog.new_blob(name, dtype, shape))
            made[-1].mapped = True  # as in _allocate: dropped unsealed, its memory is never reused
    except BaseException:
        for blob in made:
            d.catalog.drop(blob)
        raise
    for blob in made:
        d.catalog.put(v, blob)
    return {"blobs": [{"name": b.name, **b.where()} for b in made]}


@route("POST", _V + r"/seal")
def _seal_many(d: Daemon, req: Request) -> dict[str, Any]:
    """Declare many allocated blobs written, with their checksums; every one is checked before any is
    sealed."""
    job, step, body = req.job(), req.step(), req.json()
    items, save_id = _batch(body, '"name", "digests"'), _save_id(body.get("save_id"))
    checked = []
    for item in items:
        blob = d.catalog.pending_blob(job, step, check_name(item.get("name")), save_id)
        digests, n_chunks = item.get("digests"), -(-blob.nbytes // CHUNK)
        if not (isinstance(digests, list) and len(digests) == n_chunks
                and all(type(x) is int and 0 <= x < 2**64 for x in digests)):  # fmt: skip
            raise BadRequestError(f"digests of {blob.name!r} must be {n_chunks} unsigned 64-bit integers")
        checked.append((blob, digests))
    with d.catalog.lock:
        for blob, digests in checked:
            blob.digests, blob.sealed = digests, True
    return {"sealed": len(checked)}


def _batch(body: dict[str, Any], fields: str) -> list[dict[str, Any]]:
    items = body.get("blobs")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items) or len(items) > MAX_BOXES:
        raise BadRequestError(f'expected {{"blobs": [{{{fields}}}, ...]}} with at most {MAX_BOXES} blobs')
    return items


def _boxes(d: Daemon, job: str, step: int, body: dict[str, Any]) -> list[tuple[Blob, Box]]:
    """The (blob, box) pairs of a read, the blobs held (`release` them once served)."""
    items = body.get("boxes")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise BadRequestError('expected {"boxes": [{"name": ..., "box": [[start, stop], ...]}, ...]}')
    if len(items) > MAX_BOXES:
        raise TooLargeError(f"{len(items)} boxes in one request; at most {MAX_BOXES}")
    names = [check_name(item.get("name")) for item in items]
    blobs = d.catalog.hold_blobs(job, step, names, _save_id(body.get("save_id"), ANY))
    try:
        return [(b, check_box(item.get("box"), b.shape)) for b, item in zip(blobs, items)]
    except BaseException:
        d.catalog.release(blobs)
        raise


@route("POST", _V + r"/read")
def _read(d: Daemon, req: Request) -> None:
    """Read many boxes of a version's blobs: a JSON preamble, then the raw bytes of each box."""
    job, step = req.job(), req.step()
    d.send_parts(req, _boxes(d, job, step, req.json()), f"{job}@{step}")  # releases the blobs _boxes held


@route("POST", _V + r"/locate")
def _locate(d: Daemon, req: Request) -> dict[str, Any]:
    """Where a version's blobs live in shared memory, with their checksums (same-host readers). The blobs
    are held for this connection until `POST /v1/release` names the lease (or the connection closes)."""
    job, step, body = req.job(), req.step(), req.json()
    names = body.get("names")
    if not isinstance(names, list) or len(names) > MAX_BOXES:
        raise BadRequestError(f'expected {{"names": [...]}} with at most {MAX_BOXES} names')
    blobs = d.catalog.hold_blobs(
        job, step, [check_name(n) for n in names], _save_id(body.get("save_id"), ANY)
    )
    return {"blobs": [b.info(local=True) for b in blobs], "lease": req.lease(blobs)}


@route("POST", r"/v1/release")
def _release(d: Daemon, req: Request) -> dict[str, Any]:
    """End a lease of `locate` (or a local relay answer): its blobs' files may be reused again."""
    lease = req.json().get("lease")
    if type(lease) is not int:
        raise BadRequestError('expected {"lease": N}')
    held = req.unlease(lease)
    d.catalog.release(held)
    return {"released": len(held)}


@route("POST", r"/v1/relay")
def _relay(d: Daemon, req: Request) -> dict[str, Any] | None:
    """Fetch boxes from a remote store once and serve them to this host's ranks."""
    body = req.json()
    blobs = d.relay.get(body)  # held for this answer
    if body.get("local"):
        return {"blobs": [b.info(local=True) for b in blobs], "lease": req.lease(blobs)}
    d.send_parts(req, [(b, Box.full(b.shape)) for b in blobs], "relay")  # releases them
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


def _save_id(value: Any, default: Any = None) -> Any:
    return default if value is None else check_save_id(value)


def _query_save(req: Request, default: Any = ANY) -> Any:
    return _save_id(req.query.get("save_id", [None])[0], default)


def _protect(value: Any) -> tuple[int, str | None] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise BadRequestError("protect must be [step, save_id or null]")
    return check_step(value[0]), _save_id(value[1])


def _origin(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 1024):
        raise BadRequestError("replica_of must be a store URL")
    return value


@route("POST", r"/v1/hello", public=True)
def _hello(d: Daemon, req: Request) -> dict[str, Any]:
    """The handshake's first step (`auth`): prove this store holds the token, for a URL that is its own,
    and challenge the client with a nonce of its own."""
    body = req.json()
    nonce, url = check_nonce(body.get("nonce")), body.get("url")
    if not (isinstance(url, str) and len(url) <= 1024):
        raise BadRequestError('expected {"nonce": 16 to 128 characters, "url": URL}')
    if d.token is None or req.session is None:
        raise BadRequestError("this store runs without a token: there is nothing to prove")
    if not is_own_url(url, d.url, d.port, d.bound, _arrived(req)):
        raise BadRequestError(f"{url[:200]!r} is not this store's URL")
    req.session.challenge = Challenge(d.token, nonce, url)
    return {"url": d.url, **req.session.challenge.answer}


@route("POST", r"/v1/auth", public=True)
def _auth(d: Daemon, req: Request) -> dict[str, Any]:
    """The handshake's second step: the client's proof of the token answers this connection's challenge
    (once); the connection is then authenticated."""
    proof = req.json().get("proof")
    s = req.session
    if s is None or s.challenge is None:
        raise AuthError("no challenge on this connection: POST /v1/hello first")
    challenge, s.challenge = s.challenge, None
    challenge.check(proof)
    d.promote(s)
    return {"ok": True}


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


ROUTES = RouteTable([*_table, *DATASET_ROUTES])


def _arrived(req: Request) -> str | None:
    """The local address the request's connection arrived on (None when it cannot be told)."""
    try:
        name = req.conn.sock.getsockname()
    except OSError:
        return None
    return str(name[0]) if isinstance(name, tuple) else None
