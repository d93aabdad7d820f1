"""The store's HTTP API: one handler per route, each taking the `Daemon` and the `Request`.

`ROUTES` is the table the server dispatches on and the OpenAPI document (`GET /v1/openapi.json`) is
generated from. Here: the store's own routes (health, stats, jobs, retention, relay, peers, the
handshake); the routes of versions and blobs come from `version_routes`, those of datasets from
`dataset_routes`.
"""

from __future__ import annotations

import os
from typing import Any

from ..ptc import Box
from .auth import Challenge, check_nonce, is_own_url
from .daemon import Daemon
from .dataset_routes import DATASET_ROUTES
from .errors import AuthError, BadRequestError, NotFoundError
from .keys import check_job, check_step
from .request import Request, RouteTable
from .shm import host_id
from .version_routes import VERSION_ROUTES, check_origin, check_save

PROTOCOL_VERSION = 1

_table = RouteTable()
route = _table.route


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
    keep, protect, origin = (
        body.get("keep"),
        _protect(body.get("protect")),
        check_origin(body.get("replica_of")),
    )
    if origin is not None:
        return {"deleted": d.catalog.retain(job, keep, protect, origin)}
    try:
        deleted = d.catalog.retain(job, keep, protect)
    except NotFoundError:  # no own save of the job here: its copies on the targets may still be
        deleted = []
    for s in deleted:
        d.relay.drop(job, s)
    return {"deleted": deleted, "replicas": d.replicator.retain(job, keep, protect)}


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


def _protect(value: Any) -> tuple[int, str | None] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise BadRequestError("protect must be [step, save_id or null]")
    return check_step(value[0]), check_save(value[1])


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


ROUTES = RouteTable([*_table, *VERSION_ROUTES, *DATASET_ROUTES])


def _arrived(req: Request) -> str | None:
    """The local address the request's connection arrived on (None when it cannot be told)."""
    try:
        name = req.conn.sock.getsockname()
    except OSError:
        return None
    return str(name[0]) if isinstance(name, tuple) else None
