"""Relay: this host's store fetches a box of a blob held by a remote store once and serves it to local ranks.

Without it, every rank of a host that needs the same remote bytes pulls them across the network itself.
A request names many boxes; the missing ones are fetched from the peer in batched reads over one
proven connection (a round trip and a peer proof per box cost more than a small box's bytes). Concurrent
requests for the same piece wait for the first fetch (single flight). Cached pieces count
against the memory limit and stay until the local version (job, step) is deleted or dropped explicitly.
A piece is keyed by the save it was read from (`save_id`; a request without one is pinned to the save the
peer shows): a request for one save is never answered with another's bytes; the fetch itself is a checked
network read (trailer checksums) of that save. A piece whose job was dropped while it was being fetched
serves its request only and is never cached (it would outlive the drop).
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
from .errors import BadRequestError, NotFoundError
from .fanout import read_many
from .keys import check_box, check_job, check_name, check_step

Key = tuple[str, str, int, str, str, str]  # peer, job, step, blob, box, save id
MAX_RELAY = 4096  # boxes in one relay request
FETCHES = 4  # network reads in flight for one relay request


class RelayCache:
    """Relayed pieces in `catalog`'s memory, fetched with clients made by `connect(peer_url)`."""

    def __init__(self, catalog: Catalog, connect: Callable[[str], StoreClient]) -> None:
        self.catalog, self.connect = catalog, connect
        self.blobs: dict[Key, Blob] = {}
        self._pending: dict[Key, threading.Event] = {}
        self._listings: dict[tuple[str, str, int, str], dict[str, dict]] = {}  # a peer's blobs of a save
        self._listing_locks: dict[tuple[str, str, int, str], threading.Lock] = {}
        self._drops: dict[str, int] = {}  # drops of each job's pieces: a fetch that saw one is not cached
        self._lock = threading.Lock()

    def get(self, body: dict[str, Any]) -> list[Blob]:
        """The pieces a relay request body names (`boxes`: [{name, box}], box null: the whole blob), in its
        order, each held (`release` them once served); the missing ones are fetched from the peer together,
        over one connection. Without a `save_id` the request is pinned to the save the peer shows now."""
        peer, job = str(body.get("peer")), check_job(body.get("job"))
        step, save_id = check_step(body.get("step")), body.get("save_id")
        save_id = self._pin(peer, job, step) if save_id is None else check_save_id(save_id)
        items = body.get("boxes")
        if not isinstance(items, list) or not items or len(items) > MAX_RELAY:
            raise BadRequestError(f'expected "boxes": [{{"name": ..., "box": ...}}, ...] (1 to {MAX_RELAY})')
        if not all(isinstance(i, dict) for i in items):
            raise BadRequestError('every entry of "boxes" must be {"name": ..., "box": ...}')
        order: list[Key] = []  # one per entry (a box named twice is served twice), fetched once
        wanted: dict[Key, Any] = {}
        for i in items:
            box = i.get("box")
            order.append((peer, job, step, check_name(i.get("name")), json.dumps(box), save_id))
            wanted[order[-1]] = box
        got: dict[Key, Blob] = {}  # each held once; once more for each further entry naming it
        try:
            while len(got) < len(wanted):
                self._round(peer, job, step, save_id, wanted, got)
        except BaseException:
            self.catalog.memory.release(got.values())
            raise
        seen: set[Key] = set()
        with self.catalog.lock:
            for k in order:
                if k in seen:
                    got[k].refs += 1
                seen.add(k)
        return [got[k] for k in order]

    def _round(self, peer: str, job: str, step: int, save_id: str, wanted: dict[Key, Any], got: dict) -> None:
        """Hold the cached pieces, fetch the missing ones no other request is fetching, and wait for those
        (used if that fetch cached them, else fetched in the next round)."""
        mine: dict[Key, threading.Event] = {}
        others: list[threading.Event] = []
        with self._lock:
            drops = self._drops.get(job, 0)
            for k in wanted:
                if k in got:
                    continue
                if k in self.blobs:
                    got[k] = self.catalog.memory.hold(self.blobs[k])
                elif k in self._pending:
                    others.append(self._pending[k])
                else:
                    mine[k] = self._pending[k] = threading.Event()
        try:
            if mine:
                fetched = self._fetch(peer, job, step, save_id, [(k[3], wanted[k]) for k in mine])
                self._insert(job, drops, dict(zip(mine, fetched)), got)
        finally:
            with self._lock:
                for k in mine:
                    self._pending.pop(k, None)
            for event in mine.values():
                event.set()
        for event in others:
            event.wait(600)

    def _insert(self, job: str, drops: int, fetched: dict[Key, Blob], got: dict[Key, Blob]) -> None:
        """Hold fetched pieces for this request and cache them, unless the job's pieces were dropped while
        they were on the way (a `drop_relay`, a delete): then they serve this request only and are freed
        with its last holder, never left in the cache."""
        with self._lock:
            for k, b in fetched.items():
                got[k] = self.catalog.memory.hold(b)
            stale = self._drops.get(job, 0) != drops
            if not stale:
                self.blobs.update(fetched)
        if stale:
            for b in fetched.values():
                self.catalog.memory.drop(b)

    def _pin(self, peer: str, job: str, step: int) -> str:
        """The save `peer` shows for (job, step) now: a request without a save id is served from it only."""
        found = self.connect(peer).request("GET", f"/v1/jobs/{job}/versions/{step}/manifest")
        if found.get("save_id") is None:
            raise BadRequestError(f"relay of {job}@{step}: the peer's version has no save id; name one")
        return check_save_id(found["save_id"])

    def _fetch(
        self, peer: str, job: str, step: int, save_id: str, items: list[tuple[str, Any]]
    ) -> list[Blob]:
        c = self.connect(peer)  # kept per peer: each new connection of it is proven before use
        made: list[Blob] = []
        try:
            infos = self._listing(c, peer, job, step, save_id, [name for name, _ in items])
            reads = []
            for name, raw in items:
                info = infos.get(name)
                if info is None:
                    raise NotFoundError(f"{peer} has no blob {name!r} in {job}@{step}")
                b = check_box(raw, tuple(info["shape"]))
                made.append(
                    self.catalog.memory.new_blob(f"relay {peer} {job}@{step}/{name}", info["dtype"], b.shape)
                )
                reads.append(
                    (c, job, step, name, b, blob_array(memoryview(made[-1].mem), info["dtype"], b.shape))
                )
            sums: dict[int, list[int]] = {}  # the checksums verified on arrival, by id of the piece's array
            read_many(reads, FETCHES, save_id, sums)  # checked network reads (trailer checksums), batched
        except BaseException:
            for blob in made:
                self.catalog.memory.drop(blob)
            raise
        for blob, read in zip(made, reads):  # each piece's array is its whole blob, so those are its own
            known = sums.get(id(read[5]))
            blob.digests = known if known is not None else chunk_digests(memoryview(blob.mem))
            blob.sealed = True
        return made

    def _listing(
        self, c: StoreClient, peer: str, job: str, step: int, save_id: str, names: list[str]
    ) -> dict[str, dict]:
        """The peer's blobs of the version by name, asked once per save: the blobs of a save never change
        (a later save of the step has another id), and a listing that lacks a name is asked again. A
        listing only says what to allocate; the read itself is of that save and checked."""
        key = (peer, job, step, save_id)
        with self._lock:  # fetches of one save that start together wait for one listing (single flight)
            one = self._listing_locks.setdefault(key, threading.Lock())
        with one:
            with self._lock:
                known = self._listings.get(key)
            if known is None or not all(n in known for n in names):
                known = {i["name"]: i for i in c.blobs(job, step, save_id)}
                with self._lock:
                    self._listings[key] = known
        return known

    def drop(self, job: str, step: int | None) -> int:
        """Free cached pieces of `job` (at `step`, or every step when None)."""

        def of(key: tuple) -> bool:  # keys of pieces and of listings alike: (peer, job, step, ...)
            return key[1] == job and (step is None or key[2] == step)

        with self._lock:
            self._drops[job] = self._drops.get(job, 0) + 1
            gone = [self.blobs.pop(k) for k in [k for k in self.blobs if of(k)]]
            for k in [k for k in self._listing_locks if of(k)]:
                self._listings.pop(k, None)
                del self._listing_locks[k]
        for b in gone:
            self.catalog.memory.drop(b)
        return len(gone)

    def close(self) -> None:
        with self._lock:
            gone, self.blobs = list(self.blobs.values()), {}
            self._listings.clear()
            self._listing_locks.clear()
        for b in gone:
            b.release()
