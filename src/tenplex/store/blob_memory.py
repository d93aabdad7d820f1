"""The memory of blobs: counted against the store's limit when taken, and given back to the arena when a
blob is deleted, or later, when the last request serving it releases it (a reused file can never be
overwritten under a reader)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from math import prod

from ..ptc import item_size
from .arena import Arena
from .errors import MemoryLimitError, NotFoundError
from .versions import Blob


class BlobMemory:
    """Blobs' memory and their holders; shares the catalog's lock (a lookup and its hold are one step)."""

    def __init__(self, arena: Arena, limit: int, lock: threading.RLock) -> None:
        self.arena = arena
        self.limit = limit
        self.used = 0
        self.lock = lock

    def new_blob(self, name: str, dtype: str, shape: tuple[int, ...]) -> Blob:
        """Count and take the memory of a blob that is not in the catalog yet."""
        nbytes = prod(shape) * item_size(dtype)
        cost = self.arena.footprint(nbytes)  # what it takes in memory: the limit counts it whole
        with self.lock:
            if self.used + cost > self.limit:
                raise MemoryLimitError(
                    f"writing {name!r} ({nbytes} bytes) would exceed the memory limit "
                    f"({self.used} of {self.limit} bytes used); delete versions or use retain"
                )
            self.used += cost
        try:
            place = self.arena.create(nbytes)
        except BaseException:
            self.free(cost)
            raise
        with self.lock:  # taken from the slab or the pool, or on pages freed for it: trimmed only after
            self.arena.trim(self.limit - self.used)  # recycled memory never takes the store past its limit
        return Blob(name, dtype, shape, place)

    def free(self, nbytes: int) -> None:
        with self.lock:
            self.used -= nbytes

    def drop(self, blob: Blob) -> None:
        """Delete a blob: its memory and file are given back now, or when the last holder releases it."""
        with self.lock:
            if blob.dead:
                return
            blob.dead = True
            if blob.refs:
                return
        self._free_file(blob)

    def _free_file(self, blob: Blob) -> None:
        self.free(self.arena.footprint(blob.nbytes))
        if blob.mapped and not blob.sealed:
            self.arena.discard(blob.place, blob.nbytes)
        else:  # to the reserve's free ranges, or the pool for the next blob of the same size
            self.arena.recycle(blob.place, blob.nbytes)

    def hold(self, blob: Blob) -> Blob:
        """Count one more request serving `blob`; NotFoundError if it was deleted meanwhile."""
        with self.lock:
            if blob.dead:
                raise NotFoundError(f"blob {blob.name!r} was deleted")
            blob.refs += 1
        return blob

    def release(self, blobs: Iterable[Blob]) -> None:
        """End the requests `hold` counted; a deleted blob's file is freed with its last holder."""
        freed = []
        with self.lock:
            for b in blobs:
                b.refs -= 1
                if b.refs == 0 and b.dead:
                    freed.append(b)
        for b in freed:
            self._free_file(b)
