"""Replication: after a commit, push the version's blobs to the next R stores of the peer ring.

The push uses the network path (peers are other hosts), sends blob bytes straight from shared memory, and
each peer refuses a blob whose chunk checksums differ from the sender's. A copy lives on the peer under
(this store, save id), apart from the peer's own blobs; pushes of one (job, step) run one after another (a
newer save's push cancels and follows the older one), so a peer never ends with an older save's copy. The
blobs are held while they are sent, so deleting the version meanwhile cannot hand their files to another
blob. The blob listing records every store that holds a copy, so the state of a lost host can be found.

A copy is committed naming its blobs, so a peer that lost blobs of it meanwhile refuses it; a push that
failed or was cancelled deletes its partial copy on the peer (which then refuses any later write of that
save) and leaves `replication` as `failed: …`/`cancelled: …`, never `done`. `retain` reaches the copies
of this store's saves on its targets (`Replicator.retain`), so copies obey the primary's retention.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..util import logs
from .catalog import Catalog, Version
from .checksum import chunks
from .client import StoreClient
from .errors import NotFoundError, StoreError
from .transport import parse_url

log = logs.get("store")


def ring_targets(me: str, peers: list[str], replicas: int) -> list[str]:
    """The `replicas` stores after `me` in the ring `peers` (all peers from the start if `me` is absent)."""
    ring = [p for p in peers if p != me]
    if me in peers:
        i = peers.index(me)
        ring = [p for p in peers[i + 1 :] + peers[:i] if p != me]
    return ring[:replicas]


@dataclass(eq=False)
class _Push:
    job: str
    step: int
    v: Version
    targets: list[str]
    before: _Push | None  # the push of an older save of the same step: this one waits for it
    cancelled: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


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
        self._pushes: dict[tuple[str, int], _Push] = {}  # the newest push of each (job, step)
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
        with self._lock:
            before = self._pushes.get((job, step))
            push = _Push(job, step, v, list(self.targets), before)
            self._pushes[(job, step)] = push
        if before is not None:
            before.cancelled.set()  # a newer save of the step replaces it: its copies would be stale
        push.thread = threading.Thread(target=self._run, args=(push,), daemon=True)
        push.thread.start()

    def wait(self, job: str, step: int, timeout: float | None = None) -> None:
        """Until the newest push of (job, step) ended (it follows every older one), or `timeout`."""
        with self._lock:
            push = self._pushes.get((job, step))
        if push is not None and push.thread is not None:
            push.thread.join(timeout)

    def cancel(self, job: str, step: int) -> None:
        """The version was deleted: stop pushing it (a push under way ends after its current blob)."""
        with self._lock:
            push = self._pushes.get((job, step))
        while push is not None:
            push.cancelled.set()
            push = push.before

    def _run(self, push: _Push) -> None:
        if push.before is not None and push.before.thread is not None:
            push.before.thread.join()
        push.before = None
        v = push.v
        held = self.catalog.hold_version(v)
        own = held or []
        try:
            if held is None:
                raise _Cancelled(None)  # deleted before its push began: nothing was sent
            self._push(push, own)
            v.replication = "done"
        except _Failed as e:
            v.replication = f"failed: {e.peer}: {e.__cause__}"
            log.warning("replication of %s@%d to %s failed: %s", push.job, push.step, e.peer, e.__cause__)
            self._undo(push, e.peer)
        except _Cancelled as e:
            v.replication = "cancelled: the version was deleted or saved again"
            self._undo(push, e.peer)
        finally:
            self.catalog.memory.release(own)
            with self._lock:
                if self._pushes.get((push.job, push.step)) is push:
                    del self._pushes[(push.job, push.step)]

    def _push(self, push: _Push, own: list) -> None:
        for peer in push.targets:
            try:
                self._push_to(push, own, peer)
            except (StoreError, OSError, ValueError) as e:
                raise _Failed(peer) from e
            with self.catalog.lock:
                for blob in own:
                    blob.copies.append(peer)

    def _push_to(self, push: _Push, own: list, peer: str) -> None:
        job, step, v, me = push.job, push.step, push.v, self.url
        c = self.connect(peer)  # the daemon's client of that peer, shared: not closed here
        c.create_version(job, step, save_id=v.save_id, replica_of=me)
        for b in own:
            if push.cancelled.is_set():
                raise _Cancelled(peer)
            pieces = chunks(memoryview(b.mem))
            c.put_raw(
                job, step, b.name, b.dtype, b.shape, pieces, b.digests, replica_of=me, save_id=v.save_id
            )
        if push.cancelled.is_set():
            raise _Cancelled(peer)
        names = [b.name for b in own]
        info = c.commit(job, step, v.manifest, replica_of=me, blobs=names, save_id=v.save_id)
        if not info.get("committed") or info.get("save_id") != v.save_id:
            raise StoreError(f"{peer} did not commit the copy of save {v.save_id}: {info}")

    def _undo(self, push: _Push, peer: str | None) -> None:
        """Delete the partial copy a push left on `peer` (best effort: a peer that is gone holds none)."""
        if peer is None or push.v.save_id is None:
            return
        try:
            self.connect(peer).delete_copy(push.job, push.step, self.url, push.v.save_id)
        except (StoreError, OSError) as e:
            log.warning("could not delete the partial copy of %s@%d on %s: %s", push.job, push.step, peer, e)

    def retain(self, job: str, keep: int | None, protect: tuple[int, str | None] | None) -> dict[str, str]:
        """Apply a retain of this store's saves to their copies on its targets: {target: ok | failed: …}."""
        out: dict[str, str] = {}
        for peer in self.targets:
            try:
                self.connect(peer).retain(job, keep, protect, replica_of=self.url)
                out[peer] = "ok"
            except NotFoundError:  # holds no copy of the job
                out[peer] = "ok"
            except (StoreError, OSError) as e:
                out[peer] = f"failed: {e}"
        return out


class _Cancelled(Exception):
    """A push stopped for a newer save or a delete, at `peer` (None: before it began)."""

    def __init__(self, peer: str | None) -> None:
        super().__init__(peer)
        self.peer = peer


class _Failed(_Cancelled):
    """A push to `peer` failed (the cause is chained); caught before `_Cancelled`."""

    peer: str
