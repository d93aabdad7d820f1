"""The tensor store daemon's state: the shared-memory arena, the catalog of versions and blobs, replication,
the relay cache and the registered datasets, served by `Server` through the route table in `routes`.

Blob bodies are raw C-order bytes received straight into shared memory and sent straight from it
(contiguous boxes) or through one reusable buffer per connection (strided boxes).
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ptc import Box
from ..util import logs
from .arena import Arena
from .boxio import SCRATCH, as_bytes, blob_array, pieces
from .catalog import Blob, Catalog
from .checksum import CHUNK, StreamDigests, byte_span, cuts, digest, span_digests, verify_edges, verify_span
from .client import StoreClient
from .datasets import Registry
from .errors import BadRequestError
from .protocol import json_body
from .read_body import PREAMBLE
from .relay import RelayCache
from .replication import Replicator
from .request import Request, Route
from .server import Server, headers_for
from .transport import DEFAULT_PORT

log = logs.get("store")
MAX_PEERS = 64  # peer stores whose clients (and idle connections) are kept


@dataclass(frozen=True)
class StoreConfig:
    """What a store is started with (`tenplex store`'s flags, parsed: see `main`)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    memory_limit: int = 16 << 30
    token: str | None = None
    peers: Sequence[str] = ()  # the replication ring
    replicas: int = 0
    advertise: str | None = None  # this store's URL as peers know it
    shm_root: str | None = None  # where its memory directory goes (default: /dev/shm)
    huge_pages: str = "off"
    reserve: int = 0  # bytes taken at start for the first blobs' pages


class Daemon(Server):
    """One store: its state, the bulk helpers its handlers share, and `serve_forever` from `Server`."""

    def __init__(self, routes: list[Route], config: StoreConfig) -> None:
        c = config
        super().__init__(c.host, c.port, c.token, routes)
        # new at every start: a store that restarted is another store, whose "I have nothing" says nothing
        # about what the one before it held (docs/consistency.md)
        self.incarnation = secrets.token_hex(8)
        self.bound = str(self.sock.getsockname()[0])
        shown = c.host if c.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self.url = c.advertise or f"http://{_bracket(shown)}:{self.port}"
        self.arena = Arena(str(self.port), c.shm_root, c.huge_pages, c.memory_limit, c.reserve)
        if self.arena.memory.notice and c.huge_pages == "auto":
            log.warning("%s; blobs go to the plain directory", self.arena.memory.notice)
        self.catalog = Catalog(self.arena, min(c.memory_limit, self.arena.capacity()))
        self.replicator = Replicator(self.catalog, self.url, self.peer, list(c.peers), c.replicas)
        self._peer_clients: dict[str, StoreClient] = {}
        self._clients_lock = threading.Lock()
        self.relay = RelayCache(self.catalog, self.peer)
        self.datasets = Registry()

    def peer(self, url: str) -> StoreClient:
        """The network client of another store for relay fetches and replica pushes, kept per URL so that
        its connections are reused; each new one proves the peer holds this store's token before it is
        used (`auth.handshake`)."""
        with self._clients_lock:
            c = self._peer_clients.pop(url, None) or StoreClient(url, token=self.token or "", local=False)
            self._peer_clients[url] = c  # the most recently used last
            old = [self._peer_clients.pop(u) for u in list(self._peer_clients)[:-MAX_PEERS]]
        for o in old:
            o.close()
        return c

    def close(self) -> None:
        """Stop serving and release every blob file and the shared-memory directory."""
        super().close()
        self.catalog.close()
        self.relay.close()
        with self._clients_lock:
            peers, self._peer_clients = list(self._peer_clients.values()), {}
        for c in peers:
            c.close()
        self.arena.close()

    def end_leases(self, leases: dict[int, list[Any]]) -> None:
        for held in leases.values():
            self.catalog.memory.release(held)

    def send_parts(self, req: Request, parts: list[tuple[Blob, Box]], what: str) -> None:
        """Stream the boxes, then the checksums of what was sent (a trailer the receiver verifies its bytes
        against). A contiguous box sends the stored checksums of the whole chunks it covers, so the
        receiver's check is the one against what was saved and nothing here hashes those chunks again;
        the chunks under a strided box, and those a contiguous one covers in part, are verified first
        (their trailer checksums are computed here, over verified bytes; corruption there is a clean
        JSON error). The
        blobs must be held (`Catalog.hold`) by the caller, so their files cannot be reused meanwhile; this
        releases them, once: after their last byte went out and before the trailer, so that a reader that
        has its answer finds them released (a delete then frees their memory at once), or on an error."""
        held = {"parts": True}

        def release() -> None:
            if held.pop("parts", False):
                self.catalog.memory.release(b for b, _ in parts)

        try:
            self._send_parts(req, parts, what, release)
        finally:
            release()

    def _send_parts(
        self, req: Request, parts: list[tuple[Blob, Box]], what: str, sent_all: Callable[[], None]
    ) -> None:
        described, contiguous, views = [], [], []
        for blob, box in parts:
            lo, hi = byte_span(box, blob.shape, blob.itemsize)
            view = blob_array(memoryview(blob.mem), blob.dtype, blob.shape)[box.slices()]
            views.append(view)
            flat = view.flags.c_contiguous
            check = verify_edges if flat else verify_span
            check(memoryview(blob.mem), blob.digests, lo, hi, f"{what} {blob.name!r}")
            n = box.volume * blob.itemsize
            contiguous.append(span_digests(memoryview(blob.mem), blob.digests, lo, hi) if flat else None)
            described.append({"dtype": blob.dtype, "nbytes": n, "skew": lo % CHUNK if flat else 0})
        count = sum(len(cuts(p["nbytes"], p["skew"])) for p in described)
        meta = json_body({"parts": described, "digests": count})
        total = PREAMBLE.size + len(meta) + sum(p["nbytes"] for p in described) + 8 * count
        head = PREAMBLE.pack(len(meta)) + meta
        req.conn.send_head("HTTP/1.1 200 OK", headers_for(total, "application/octet-stream"), head)
        sent: list[int] = []
        batch: list[memoryview] = []  # contiguous boxes, sent together: one call for many small ones
        for view, known in zip(views, contiguous):
            if known is not None:
                batch.append(as_bytes(view))
                sent.extend(known)
                continue
            req.conn.send_many(batch)  # before the scratch buffer is reused
            batch.clear()
            stream = StreamDigests()
            for piece in pieces(view, scratch(req)):
                stream.update(piece)
                req.conn.send(piece)
            sent.extend(stream.finish())
        req.conn.send_many(batch)
        sent_all()
        req.conn.send(struct.pack(f"<{len(sent)}Q", *sent))
        self.count("bytes_out", total)

    def receive_blob(self, req: Request, name: str, dtype: str, shape: tuple[int, ...]) -> Blob:
        """Receive a raw body into a new blob's shared memory, hashing each chunk as it arrives."""
        blob = self.catalog.memory.new_blob(name, dtype, shape)
        if req.length != blob.nbytes:
            self.catalog.memory.drop(blob)
            raise BadRequestError(f"body has {req.length} bytes, {dtype}{list(shape)} needs {blob.nbytes}")
        data = memoryview(blob.mem)
        try:
            for i in range(0, blob.nbytes, CHUNK):
                req.conn.read_into(data[i : i + CHUNK])
                blob.digests.append(digest(data[i : i + CHUNK]))
        except BaseException:
            self.catalog.memory.drop(blob)
            raise
        finally:
            data.release()
        req.consumed = True
        blob.sealed = True
        self.count("bytes_in", blob.nbytes)
        return blob


def scratch(req: Request) -> np.ndarray:
    """The connection's reusable send buffer, allocated on its first strided answer."""
    if not req.scratch:
        req.scratch.append(np.empty(SCRATCH, dtype=np.uint8))
    return req.scratch[0]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
