"""Replication: after a commit, push the version's blobs to the next R stores of the peer ring.

The push uses the network path (peers are other hosts), sends blob bytes straight from shared memory, and
checks that each peer computed the same chunk checksums. The blob listing records every store that holds a
copy, so the state of a lost host can still be found.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..util import logs
from .catalog import Catalog, Version
from .checksum import chunks
from .client import StoreClient
from .errors import StoreError
from .transport import parse_url

log = logs.get("store")


def ring_targets(me: str, peers: list[str], replicas: int) -> list[str]:
    """The `replicas` stores after `me` in the ring `peers` (all peers from the start if `me` is absent)."""
    ring = [p for p in peers if p != me]
    if me in peers:
        i = peers.index(me)
        ring = [p for p in peers[i + 1 :] + peers[:i] if p != me]
    return ring[:replicas]


class Replicator:
    """Pushes committed versions of `catalog` (this store, `url`) to its ring targets, with clients made by
    `connect(peer_url)`."""

    def __init__(
        self,
        catalog: Catalog,
        url: str,
        connect: Callable[[str], StoreClient],
        peers: list[str],
        replicas: int,
    ) -> None:
        self.catalog, self.url, self.connect = catalog, url, connect
        self.configure(peers, replicas)
        self._threads: dict[tuple[str, int], threading.Thread] = {}
        self._lock = threading.Lock()

    def configure(self, peers: list[str], replicas: int) -> None:
        for p in peers:
            parse_url(p)
        self.peers, self.replicas = list(peers), replicas
        self.targets = ring_targets(self.url, self.peers, replicas)

    def start(self, job: str, step: int, v: Version) -> None:
        if not self.targets:
            return
        v.replication = "pending"
        t = threading.Thread(target=self._push, args=(job, step, v, list(self.targets)), daemon=True)
        with self._lock:
            self._threads[(job, step)] = t
        t.start()

    def wait(self, job: str, step: int, timeout: float | None = None) -> None:
        with self._lock:
            t = self._threads.get((job, step))
        if t is not None:
            t.join(timeout)

    def _push(self, job: str, step: int, v: Version, targets: list[str]) -> None:
        try:
            for peer in targets:
                c = self.connect(peer)
                try:
                    c.create_version(job, step)
                    own = [b for b in list(v.blobs.values()) if b.origin is None]  # not copies of a peer's
                    me = self.url
                    for b in own:
                        pieces = chunks(memoryview(b.mem))
                        c.put_raw(job, step, b.name, b.dtype, b.shape, pieces, b.digests, replica_of=me)
                    c.commit(job, step, v.manifest, replica_of=self.url)
                finally:
                    c.close()
                with self.catalog.lock:
                    for blob in own:
                        blob.copies.append(peer)
            v.replication = "done"
        except (StoreError, OSError, ValueError) as e:
            v.replication = f"failed: {e}"
            log.warning("replication of %s@%d failed: %s", job, step, e)
        finally:
            with self._lock:
                self._threads.pop((job, step), None)
