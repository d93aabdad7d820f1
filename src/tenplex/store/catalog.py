"""The daemon's in-memory catalog: jobs → versions → blobs, memory accounting and retention.

All metadata changes happen under one lock; bulk bytes are moved outside it. A version becomes readable
only when committed, and only sealed blobs can be committed, so a reader never sees a torn blob.
"""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass, field
from math import prod
from typing import Any

from ..ptc import item_size
from .checksum import CHUNK
from .errors import BadRequestError, ConflictError, MemoryLimitError, NotFoundError
from .shm import Arena


@dataclass(eq=False)
class Blob:
    """One shard blob: C-order bytes of `shape` × `dtype` in a shared-memory file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: str
    mem: mmap.mmap | bytearray
    sealed: bool = False
    digests: list[int] = field(default_factory=list)
    copies: list[str] = field(default_factory=list)
    origin: str | None = None  # for a replica: the store whose blob this copies

    @property
    def itemsize(self) -> int:
        return item_size(self.dtype)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * item_size(self.dtype)

    def info(self, local: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
            "sealed": self.sealed, "copies": list(self.copies),
        }  # fmt: skip
        if local:  # what a same-host client needs to map and verify the blob itself
            out.update(path=self.path, chunk=CHUNK, digests=self.digests)
        return out

    def release(self) -> None:
        if isinstance(self.mem, mmap.mmap):
            try:
                self.mem.close()
            except BufferError:  # a reader still holds a view: the mapping goes when it is done
                pass


@dataclass(eq=False)
class Version:
    step: int
    blobs: dict[str, Blob] = field(default_factory=dict)
    committed: bool = False
    manifest: Any = None
    created: float = field(default_factory=time.time)
    replica_of: str | None = None
    replication: str = "none"  # none | pending | done | failed: <reason>

    def info(self) -> dict[str, Any]:
        return {
            "step": self.step, "committed": self.committed, "blobs": len(self.blobs),
            "nbytes": sum(b.nbytes for b in self.blobs.values()), "created": self.created,
            "replica_of": self.replica_of, "replication": self.replication,
            # the committer's id for this save, so readers can tell it from another attempt at the step
            "save_id": self.manifest.get("save_id") if isinstance(self.manifest, dict) else None,
        }  # fmt: skip


class Catalog:
    """Jobs, versions, blobs and the memory they take; every method is thread-safe."""

    def __init__(self, arena: Arena, memory_limit: int) -> None:
        self.arena = arena
        self.limit = memory_limit
        self.used = 0
        self.lock = threading.RLock()
        self.jobs: dict[str, dict[int, Version]] = {}

    # ---- memory

    def new_blob(self, name: str, dtype: str, shape: tuple[int, ...]) -> Blob:
        """Reserve memory and create the file of a blob that is not in the catalog yet."""
        nbytes = prod(shape) * item_size(dtype)
        with self.lock:
            if self.used + nbytes > self.limit:
                raise MemoryLimitError(
                    f"writing {name!r} ({nbytes} bytes) would exceed the memory limit "
                    f"({self.used} of {self.limit} bytes used); delete versions or use retain"
                )
            self.used += nbytes
            self.arena.trim(self.limit - self.used)  # recycled files never take the store past its limit
        try:
            path, mem = self.arena.create(nbytes)
        except BaseException:
            self.free(nbytes)
            raise
        return Blob(name, dtype, shape, path, mem)

    def free(self, nbytes: int) -> None:
        with self.lock:
            self.used -= nbytes

    def drop(self, blob: Blob) -> None:
        """Give a blob's memory back; its file goes to the pool for reuse by a blob of the same size."""
        self.free(blob.nbytes)
        self.arena.recycle(blob.path, blob.mem, blob.nbytes)

    # ---- lookups

    def version(self, job: str, step: int, committed: bool | None = None) -> Version:
        versions = self.jobs.get(job)
        if versions is None:
            raise NotFoundError(f"unknown job {job!r}")
        v = versions.get(step)
        if v is None or (committed and not v.committed):
            raise NotFoundError(f"job {job!r} has no committed version {step}")
        return v

    def blob(self, job: str, step: int, name: str) -> Blob:
        """A readable blob: only committed versions are served."""
        with self.lock:
            b = self.version(job, step, committed=True).blobs.get(name)
        if b is None:
            raise NotFoundError(f"version {step} of job {job!r} has no blob {name!r}")
        return b

    # ---- changes

    def create_version(self, job: str, step: int) -> Version:
        with self.lock:
            return self.jobs.setdefault(job, {}).setdefault(step, Version(step))

    def writable(self, job: str, step: int) -> Version:
        v = self.create_version(job, step)
        if v.committed:
            raise ConflictError(f"version {step} of job {job!r} is committed and cannot change")
        return v

    def put(self, job: str, step: int, blob: Blob) -> None:
        """Insert (or replace) a blob of an uncommitted version; drops the blob if that is impossible.

        A replica (`blob.origin` set) may also join a committed version it is missing from: this store can
        be a primary of the same save, committed before its peer's copies arrive.
        """
        with self.lock:
            v = self.create_version(job, step)
            old = v.blobs.get(blob.name)
            if v.committed and (blob.origin is None or old is not None):
                self.drop(blob)
                if blob.origin is not None:
                    return  # that copy is here already
                raise ConflictError(f"version {step} of job {job!r} is committed and cannot change")
            v.blobs[blob.name] = blob
        if old is not None:
            self.drop(old)

    def pending_blob(self, job: str, step: int, name: str) -> Blob:
        with self.lock:
            b = self.writable(job, step).blobs.get(name)
        if b is None:
            raise NotFoundError(f"version {step} of job {job!r} has no blob {name!r} to seal")
        return b

    def commit(
        self, job: str, step: int, manifest: Any, replica_of: str | None, blobs: list[str] | None = None
    ) -> tuple[Version, bool]:
        """Make a version visible; (version, True) when this call committed it, False if it already was.

        With `blobs`, those blobs make the version: each must be there and sealed; unsealed others (left by
        a writer of an abandoned attempt at this version) are dropped, sealed others (e.g. a peer's
        replicas) are kept.
        """
        with self.lock:
            v = self.version(job, step)
            if replica_of is not None and (v.committed or any(b.origin is None for b in v.blobs.values())):
                return v, False  # a copy of a peer's save where this store writes that save itself
            if v.committed and not (replica_of is None and v.replica_of is not None):
                return v, False
            wanted = v.blobs.keys() if blobs is None else blobs
            missing = [n for n in wanted if n not in v.blobs]
            if missing:
                raise ConflictError(f"cannot commit version {step} of {job!r}: blobs missing: {missing[:5]}")
            unsealed = [n for n in wanted if not v.blobs[n].sealed]
            if unsealed:
                raise ConflictError(
                    f"cannot commit version {step} of {job!r}: blobs not sealed: {unsealed[:5]}"
                )
            stale = [v.blobs.pop(n) for n in set(v.blobs) - set(wanted) if not v.blobs[n].sealed]
            v.manifest, v.replica_of, v.committed = manifest, replica_of, True
        for b in stale:
            self.drop(b)
        return v, True

    def delete_version(self, job: str, step: int) -> None:
        with self.lock:
            v = self.version(job, step)
            del self.jobs[job][step]
            if not self.jobs[job]:
                del self.jobs[job]
        for b in v.blobs.values():
            self.drop(b)

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

    def retain(self, job: str, keep: int) -> list[int]:
        """Keep the `keep` newest committed versions; also drop uncommitted ones older than those kept."""
        if type(keep) is not int or keep < 1:
            raise BadRequestError(f"keep must be a positive integer, got {keep!r}")
        with self.lock:
            if job not in self.jobs:
                raise NotFoundError(f"unknown job {job!r}")
            committed = sorted(s for s, v in self.jobs[job].items() if v.committed)
            kept = committed[-keep:]
            floor = kept[0] if kept else -1
            doomed = [s for s in self.jobs[job] if s < floor or (s in committed and s not in kept)]
        for s in doomed:
            try:
                self.delete_version(job, s)
            except NotFoundError:
                pass
        return sorted(doomed)

    def close(self) -> None:
        with self.lock:
            for versions in self.jobs.values():
                for v in versions.values():
                    for b in v.blobs.values():
                        b.release()
            self.jobs.clear()
            self.used = 0
