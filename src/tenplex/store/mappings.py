"""A client's cache of file mappings (blob files in shared memory, corpus token files).

The daemon recycles files of freed blobs for new blobs of the same size, so a periodic writer or reader
maps each file once (mapping costs about as much as copying); the oldest mappings are closed past `MAX_MAPS`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

MAX_MAPS = 1024  # mappings a client keeps open for repeated same-host reads

Key = tuple[str, int, bool]  # (path, nbytes, writable)


class Mappings:
    def __init__(self, limit: int = MAX_MAPS) -> None:
        self.limit = limit
        self._maps: OrderedDict[Key, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Key, open_: Callable[[], Any]) -> Any:
        """The cached mapping of `key`, made with `open_()` on a miss."""
        with self._lock:
            mem = self._maps.get(key)
            if mem is not None:
                self._maps.move_to_end(key)
                return mem
        mem = open_()
        with self._lock:
            self._maps[key] = mem
            while len(self._maps) > self.limit:
                self._maps.popitem(last=False)
        return mem

    def clear(self) -> None:
        with self._lock:
            self._maps.clear()
