"""The daemon's in-memory catalog: jobs → steps → saves → blobs, with their memory (`blob_memory`) and
retention (`retention`).

All metadata changes happen under one lock; bulk bytes are moved outside it. A version becomes readable
only when committed, and only sealed blobs can be committed, so a reader never sees a torn blob.

Integrity rules (see docs/store.md, "Integrity guarantees"):
- a step holds this store's own save of it and, separately, one copy per peer that replicates here, each
  keyed by its `save_id`; a read is served from the blobs of one save only, and a copy never replaces an
  own blob;
- a blob is reference-counted while a request serves it: a deleted blob's file goes back to the pool only
  when the last holder releases it, so a reused file can never be overwritten under a reader;
- a write lands only in the very version it was started for: if that version was deleted, replaced or
  committed meanwhile, the bytes are dropped and the writer gets an error;
- every write names its save: a write of another save is refused, and a deleted save is remembered
  (a tombstone) so that a late write or push of it never recreates it;
- retention goes by commit order, never step number, and never deletes the newest complete save
  (see `retain` and docs/consistency.md).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from .arena import Arena
from .blob_memory import BlobMemory
from .errors import BadRequestError, ConflictError, NotFoundError
from .retention import Protect, doomed_versions
from .versions import ANY, Blob, Slot, Version, check_save_id

__all__ = ["ANY", "Blob", "Catalog", "Slot", "Version", "check_save_id"]

TOMBSTONES = 1 << 16  # deleted saves remembered: a write of one arriving later is refused


class Catalog:
    """Jobs, steps, saves, blobs and the memory they take; every method is thread-safe."""

    def __init__(self, arena: Arena, memory_limit: int) -> None:
        self.lock = threading.RLock()
        self.memory = BlobMemory(arena, memory_limit, self.lock)
        self.jobs: dict[str, dict[int, Slot]] = {}
        self._clock = itertools.count(1)  # orders opens and commits (retention goes by it)
        self._gone: OrderedDict[tuple[str, int, str | None, str], None] = OrderedDict()

    def hold_version(self, v: Version) -> list[Blob] | None:
        """`hold` every blob of `v` (a replication push), or None when `v` was deleted meanwhile."""
        with self.lock:
            if not v.live:
                return None
            blobs = list(v.blobs.values())
            for b in blobs:
                b.refs += 1
        return blobs

    # ---- lookups

    def slot(self, job: str, step: int) -> Slot:
        with self.lock:
            versions = self.jobs.get(job)
            if versions is None:
                raise NotFoundError(f"unknown job {job!r}")
            s = versions.get(step)
            if s is None:
                raise NotFoundError(f"job {job!r} has no version {step}")
            return s

    def readable(self, job: str, step: int, save_id: Any = ANY) -> list[Version]:
        """The committed versions of one save a read of (job, step) is served from (NotFoundError if none)."""
        with self.lock:
            shown = self.slot(job, step).readable(save_id)
        if not shown:
            which = "" if save_id is ANY else f" of save {save_id}"
            raise NotFoundError(f"job {job!r} has no committed version {step}{which}")
        return shown

    def blob(self, job: str, step: int, name: str, save_id: Any = ANY) -> Blob:
        """A readable blob: only committed versions are served, and only those of one save."""
        with self.lock:
            for v in self.readable(job, step, save_id):
                if name in v.blobs:
                    return v.blobs[name]
        raise NotFoundError(f"version {step} of job {job!r} has no blob {name!r}")

    def hold_blobs(self, job: str, step: int, names: list[str], save_id: Any = ANY) -> list[Blob]:
        """Look up and `hold` blobs of one save in one step, atomically; `release` them when served."""
        with self.lock:
            blobs = [self.blob(job, step, n, save_id) for n in names]
            for b in blobs:
                b.refs += 1
        return blobs

    def listing(self, job: str) -> list[dict[str, Any]]:
        with self.lock:
            versions = self.jobs.get(job)
            if versions is None:
                raise NotFoundError(f"unknown job {job!r}")
            return [versions[s].info() for s in sorted(versions) if versions[s].versions()]

    def stats(self) -> dict[str, int]:
        with self.lock:
            slots = [s for vs in self.jobs.values() for s in vs.values()]
            versions = [v for s in slots for v in s.versions()]
            mem = self.memory
            return {"memory_used": mem.used, "memory_limit": mem.limit, "jobs": len(self.jobs),
                    "versions": len(slots), "committed": sum(bool(s.readable()) for s in slots),
                    "blobs": sum(len(v.blobs) for v in versions)}  # fmt: skip

    # ---- changes

    def create_version(
        self, job: str, step: int, save_id: str | None = None, replica_of: str | None = None
    ) -> Version:
        """The open version of (job, step) for save `save_id` — this store's own, or `replica_of`'s copy.

        Own: a committed version is kept for the same save; for another save it becomes the slot's
        `prior`, readable until retention knows the new save complete (then it goes); an open one of
        another save is an abandoned attempt and is replaced. A copy of a newer save replaces the copy of
        an older one (a peer pushes its saves of a step in order)."""
        gone: list[Version] = []
        with self.lock:
            self._refuse_deleted(job, step, save_id, replica_of)
            slot = self.jobs.setdefault(job, {}).setdefault(step, Slot())
            cur = slot.own if replica_of is None else slot.copies.get(replica_of)
            if cur is not None and cur.save_id is None and not cur.committed and save_id is not None:
                cur.save_id = save_id  # created before the writers knew their save's id
            if cur is not None and save_id is not None and cur.save_id != save_id:
                if cur.committed and replica_of is None:
                    if slot.prior is not None:  # two committed saves of a step are never kept here
                        gone.append(slot.prior)
                    slot.prior = cur
                else:
                    gone.append(cur)
                cur = None
            if cur is None:
                cur = Version(step, save_id, replica_of, born=next(self._clock))
                if replica_of is None:
                    slot.own = cur
                else:
                    slot.copies[replica_of] = cur
            for v in gone:
                self._bury(job, v)
        self._drop_all(gone)
        return cur

    def writable(
        self, job: str, step: int, save_id: str | None = None, replica_of: str | None = None
    ) -> Version:
        """The open version a new blob goes into (an own one created if absent); ConflictError if it is
        committed, belongs to another save (a write without a save id included) or was deleted. A copy is
        never created by a blob: its push opens it first, so a push racing a delete ends refused."""
        with self.lock:
            self._refuse_deleted(job, step, save_id, replica_of)
            slot = self.jobs.get(job, {}).get(step)
            cur = None if slot is None else slot.own if replica_of is None else slot.copies.get(replica_of)
            what = f"version {step} of job {job!r}" + (f" (copy of {replica_of})" if replica_of else "")
            if cur is None and replica_of is not None:
                raise ConflictError(f"{what} is not open: its push opens it first (deleted meanwhile?)")
            if cur is None:
                return self.create_version(job, step, save_id, replica_of)
            if cur.committed:
                raise ConflictError(f"{what} is committed and cannot change")
            if cur.save_id is not None and save_id != cur.save_id:
                raise ConflictError(f"{what} belongs to save {cur.save_id}, not {save_id}")
            if save_id is not None:
                cur.save_id = save_id
            return cur

    def put(self, v: Version, blob: Blob) -> None:
        """Insert (or replace) a blob of `v`, the open version it was written for; if `v` was deleted,
        replaced or committed meanwhile, the blob is dropped and ConflictError raised (never a version
        recreated by a write that started before its delete)."""
        with self.lock:
            ok = v.live and not v.committed
            old = v.blobs.get(blob.name) if ok else None
            if ok:
                v.blobs[blob.name] = blob
        if not ok:
            self.memory.drop(blob)
            state = "committed" if v.committed else "deleted or replaced"
            raise ConflictError(f"version {v.step} was {state} while blob {blob.name!r} was being written")
        if old is not None:
            self.memory.drop(old)

    def pending_blob(self, job: str, step: int, name: str, save_id: str | None = None) -> Blob:
        """The open blob a seal of save `save_id` names; ConflictError if the open version is another
        save's (a stale writer of an abandoned save must not seal a new save's blob)."""
        with self.lock:
            own = self.slot(job, step).own
            if own is None or own.committed:
                raise ConflictError(f"version {step} of job {job!r} has no open blob {name!r} to seal")
            if own.save_id is not None and save_id != own.save_id:
                raise ConflictError(
                    f"blob {name!r} of version {step} belongs to save {own.save_id}, not {save_id}"
                )
            b = own.blobs.get(name)
        if b is None:
            raise NotFoundError(f"version {step} of job {job!r} has no blob {name!r} to seal")
        return b

    def commit(
        self,
        job: str,
        step: int,
        manifest: Any,
        replica_of: str | None,
        blobs: list[str] | None = None,
        save_id: str | None = None,
    ) -> tuple[Version, bool]:
        """Make a version visible; (version, True) when this call committed it, False if it already was.

        `save_id` (default: the manifest's) must be the version's. With `blobs`, those blobs make the
        version: each must be there and sealed; others (left by a writer of an abandoned attempt at this
        version) are dropped."""
        if save_id is None and isinstance(manifest, dict) and isinstance(manifest.get("save_id"), str):
            save_id = manifest["save_id"]
        with self.lock:
            slot = self.slot(job, step)
            v = slot.own if replica_of is None else slot.copies.get(replica_of)
            what = f"version {step} of {job!r}" + (f" (copy of {replica_of})" if replica_of else "")
            if v is None:
                raise NotFoundError(f"cannot commit {what}: nothing was written")
            if save_id is not None and v.save_id not in (None, save_id):
                raise ConflictError(f"cannot commit {what} as save {save_id}: it holds save {v.save_id}")
            if v.committed:
                return v, False
            wanted = v.blobs.keys() if blobs is None else blobs
            missing = [n for n in wanted if n not in v.blobs]
            if missing:
                raise ConflictError(f"cannot commit {what}: blobs missing: {missing[:5]}")
            unsealed = [n for n in wanted if not v.blobs[n].sealed]
            if unsealed:
                raise ConflictError(f"cannot commit {what}: blobs not sealed: {unsealed[:5]}")
            stale = [v.blobs.pop(n) for n in set(v.blobs) - set(wanted)]
            v.manifest, v.committed, v.committed_at = manifest, True, time.monotonic()
            v.order = next(self._clock)
            v.save_id = save_id or v.save_id or f"unnamed-{uuid.uuid4().hex}"  # every read can name it
        for b in stale:
            self.memory.drop(b)
        return v, True

    def delete_version(self, job: str, step: int) -> None:
        """Delete a step: this store's own save of it and every copy of it."""
        with self.lock:
            gone = self.slot(job, step).versions()
            self._unlink(job, step, gone)
        self._drop_all(gone)

    def delete_open(self, job: str, step: int, save_id: str) -> bool:
        """Delete this store's open (uncommitted) version of save `save_id` at `step` — a save that failed
        on some rank — leaving the step's committed save and its copies; False when there is none."""
        with self.lock:
            slot = self.jobs.get(job, {}).get(step)
            v = None if slot is None else slot.own
            if v is None or v.committed or v.save_id != save_id:
                return False
            self._unlink(job, step, [v])
        self._drop_all([v])
        return True

    def delete_copy(self, job: str, step: int, origin: str, save_id: str) -> bool:
        """Delete `origin`'s copy of save `save_id` (a push that failed or was cancelled), and refuse any
        later write of it; False when this store holds no such copy."""
        with self.lock:
            slot = self.jobs.get(job, {}).get(step)
            v = None if slot is None else slot.copies.get(origin)
            self._gone[(job, step, origin, save_id)] = None
            if v is None or v.save_id != save_id:
                return False
            self._unlink(job, step, [v])
        self._drop_all([v])
        return True

    def delete_job(self, job: str) -> None:
        with self.lock:
            if job not in self.jobs:
                raise NotFoundError(f"unknown job {job!r}")
            steps = list(self.jobs[job])
        for s in steps:
            try:
                self.delete_version(job, s)
            except NotFoundError:
                pass

    def retain(
        self, job: str, keep: int | None, protect: Protect | None = None, origin: str | None = None
    ) -> list[int]:
        """Apply `keep` to this store's own saves of `job` (or, with `origin`, to that peer's copies here);
        returns the steps whose version was deleted. `keep=None` keeps every committed save (the saver
        marks `protect` complete and drops abandoned attempts before it). See `retention` for the rule."""
        if keep is not None and (type(keep) is not int or keep < 1):
            raise BadRequestError(f"keep must be a positive integer or null, got {keep!r}")
        with self.lock:
            if job not in self.jobs:
                raise NotFoundError(f"unknown job {job!r}")
            lineage = [
                (s, v)
                for s, slot in self.jobs[job].items()
                for v in ((slot.own, slot.prior) if origin is None else (slot.copies.get(origin),))
                if v is not None
            ]
            doomed = doomed_versions(lineage, keep, protect)
            for s, v in doomed:
                self._unlink(job, s, [v])
        self._drop_all(v for _, v in doomed)
        return sorted(s for s, _ in doomed)

    def _unlink(self, job: str, step: int, versions: list[Version]) -> None:
        """Take `versions` out of their slot (under the lock; their blobs are dropped after it)."""
        slot = self.jobs[job][step]
        for v in versions:
            if slot.own is v:
                slot.own, slot.prior = slot.prior, None  # the earlier save of the step is its own again
            if slot.prior is v:
                slot.prior = None
            slot.copies = {o: c for o, c in slot.copies.items() if c is not v}
            self._bury(job, v)
        if not slot.versions():
            del self.jobs[job][step]
            if not self.jobs[job]:
                del self.jobs[job]

    def _bury(self, job: str, v: Version) -> None:
        """Mark `v` gone (under the lock): writes started for it fail, and its save is never reopened."""
        v.live = False
        if v.save_id is not None:
            self._gone[(job, v.step, v.replica_of, v.save_id)] = None
            while len(self._gone) > TOMBSTONES:
                self._gone.popitem(last=False)

    def _refuse_deleted(self, job: str, step: int, save_id: str | None, replica_of: str | None) -> None:
        if save_id is not None and (job, step, replica_of, save_id) in self._gone:
            what = f"copy of {replica_of}" if replica_of else "version"
            raise ConflictError(
                f"save {save_id} ({what} {step} of job {job!r}) was deleted here; not recreated"
            )

    def _drop_all(self, versions: Iterable[Version]) -> None:
        for v in versions:
            for b in v.blobs.values():
                self.memory.drop(b)

    def close(self) -> None:
        with self.lock:
            for versions in self.jobs.values():
                for slot in versions.values():
                    for v in slot.versions():
                        for b in v.blobs.values():
                            b.release()
            self.jobs.clear()
            self.memory.used = 0
