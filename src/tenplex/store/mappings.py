"""A client's cache of file mappings (blob files in shared memory, corpus token files).

Entries are files, not blobs: small blobs are ranges of a few pack files (and `--reserve` ranges of one
file), each mapped once whatever the blobs in it, and the daemon recycles files of freed blobs for new
blobs of the same size, so a periodic writer or reader maps each file once, not at every save (a mapping
is set up, pre-faulted and torn down per file); the oldest mappings are closed past `MAX_MAPS`. A mapping
keeps its file's memory alive after the daemon unlinked the file (a pooled file trimmed, an empty pack
removed), so every `SWEEP` seconds the cache drops the mappings of files that are gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

MAX_MAPS = 1024  # files a client keeps mapped for repeated same-host reads and writes
SWEEP = 0.5  # seconds between checks for mappings of unlinked files

Key = tuple[str, int, bool]  # (path, nbytes, writable)


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


class Mappings:
    def __init__(self, limit: int = MAX_MAPS) -> None:
        self.limit = limit
        self._maps: OrderedDict[Key, tuple[Any, int | None]] = OrderedDict()  # -> (mapping, inode)
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    def get(self, key: Key, open_: Callable[[], Any]) -> Any:
        """The cached mapping of `key`, made with `open_()` on a miss."""
        if time.monotonic() - self._swept >= SWEEP:
            self.sweep()
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                self._maps.move_to_end(key)
                return hit[0]
        ino = _inode(key[0])
        mem = open_()
        with self._lock:
            self._maps[key] = (mem, ino)
            while len(self._maps) > self.limit:
                self._maps.popitem(last=False)
        return mem

    def sweep(self) -> int:
        """Drop the mappings whose file was unlinked (or replaced) since it was mapped; how many went."""
        with self._lock:
            self._swept = time.monotonic()
            items = list(self._maps.items())
        gone = [k for k, (_, ino) in items if _inode(k[0]) != ino]
        with self._lock:
            for k in gone:
                self._maps.pop(k, None)
        return len(gone)

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
