"""The routes of versions and blobs: open, write (PUT, or allocate and seal in shared memory), commit,
list, read, locate and delete — each taking the `Daemon` and the `Request`."""

from __future__ import annotations

from typing import Any

from ..ptc import Box
from .catalog import ANY, Blob, check_save_id
from .checksum import CHUNK, chunk_digests, list_digest
from .daemon import Daemon
from .errors import BadRequestError, ChecksumError, NotFoundError, TooLargeError
from .keys import check_box, check_dtype, check_name, check_shape
from .request import Request, RouteTable

MAX_BOXES = 4096  # boxes in one read request
MAX_BLOBS_PER_COMMIT = 1 << 20  # names a commit may list

VERSION_ROUTES = RouteTable()
route = VERSION_ROUTES.route
_V = r"/v1/jobs/(?P<job>[^/]+)/versions/(?P<step>[^/]+)"


@route("POST", _V)
def _create(d: Daemon, req: Request) -> dict[str, Any]:
    """Create an uncommitted version for a save (idempotent); a peer's copy with `replica_of`."""
    job, step, body = req.job(), req.step(), req.json()
    v = d.catalog.create_version(
        job, step, check_save(body.get("save_id")), check_origin(body.get("replica_of"))
    )
    return v.info()


@route("DELETE", _V)
def _delete(d: Daemon, req: Request) -> dict[str, Any]:
    """Delete a version; with `?replica_of=URL&save_id=S`, only that store's copy of save S here (a push
    that failed or was cancelled), which is never recreated afterwards; with `?save_id=S` alone, only this
    store's open version of save S (a save that failed)."""
    job, step = req.job(), req.step()
    origin = check_origin(req.query.get("replica_of", [None])[0])
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
    replica_of, save_id = check_origin(body.get("replica_of")), check_save(body.get("save_id"))
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
    origin = check_origin(req.query.get("replica_of", [None])[0])  # a peer's copy (replication)
    expected = req.query.get("digest", [None])[0]  # of the chunk digests: the sender's bytes
    if origin is not None and expected is None:
        raise BadRequestError("a replica PUT needs ?digest= (its sender's checksum list digest)")
    v = d.catalog.writable(job, step, _query_save(req, None), origin)
    blob = d.receive_blob(req, name, dtype, shape)
    if expected is not None and expected != f"{list_digest(blob.digests):016x}":
        d.catalog.memory.drop(blob)  # a copy that differs from what was sent is never inserted, never served
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
    v = d.catalog.writable(job, step, check_save(body.get("save_id")))
    blob = d.catalog.memory.new_blob(name, dtype, shape)
    blob.mapped = True  # the writer maps it: dropped unsealed, its memory is never reused
    d.catalog.put(v, blob)
    return blob.where()


@route("POST", _V + r"/blobs/(?P<name>[^/]+)/seal")
def _seal(d: Daemon, req: Request) -> dict[str, Any]:
    """Declare an allocated blob written; its checksums are taken or given."""
    job, step, name, body = req.job(), req.step(), req.name(), req.json()
    blob = d.catalog.pending_blob(job, step, name, check_save(body.get("save_id")))
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
    v = d.catalog.writable(job, step, check_save(body.get("save_id")))
    made: list[Blob] = []
    try:
        for name, dtype, shape in specs:
            made.append(d.catalog.memory.new_blob(name, dtype, shape))
            made[-1].mapped = True  # as in _allocate: dropped unsealed, its memory is never reused
    except BaseException:
        for blob in made:
            d.catalog.memory.drop(blob)
        raise
    for blob in made:
        d.catalog.put(v, blob)
    return {"blobs": [{"name": b.name, **b.where()} for b in made]}


@route("POST", _V + r"/seal")
def _seal_many(d: Daemon, req: Request) -> dict[str, Any]:
    """Declare many allocated blobs written, with their checksums; every one is checked before any is
    sealed."""
    job, step, body = req.job(), req.step(), req.json()
    items, save_id = _batch(body, '"name", "digests"'), check_save(body.get("save_id"))
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
    blobs = d.catalog.hold_blobs(job, step, names, check_save(body.get("save_id"), ANY))
    try:
        return [(b, check_box(item.get("box"), b.shape)) for b, item in zip(blobs, items)]
    except BaseException:
        d.catalog.memory.release(blobs)
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
        job, step, [check_name(n) for n in names], check_save(body.get("save_id"), ANY)
    )
    return {"blobs": [b.info(local=True) for b in blobs], "lease": req.lease(blobs)}


@route("POST", r"/v1/release")
def _release(d: Daemon, req: Request) -> dict[str, Any]:
    """End a lease of `locate` (or a local relay answer): its blobs' files may be reused again."""
    lease = req.json().get("lease")
    if type(lease) is not int:
        raise BadRequestError('expected {"lease": N}')
    held = req.unlease(lease)
    d.catalog.memory.release(held)
    return {"released": len(held)}


def check_save(value: Any, default: Any = None) -> Any:
    return default if value is None else check_save_id(value)


def _query_save(req: Request, default: Any = ANY) -> Any:
    return check_save(req.query.get("save_id", [None])[0], default)


def check_origin(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 1024):
        raise BadRequestError("replica_of must be a store URL")
    return value
