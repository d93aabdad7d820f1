"""Where a save or a load spends its time: seconds by phase, recorded in `SaveHandle` and `LoadInfo`.

Phases follow each other except the reads, which run in parallel: `reads` is their wall time and
`shm_reads` / `network_reads` / `relayed_reads` the wall time of each kind (they overlap). Every
optimization of the data path starts from these figures rather than from a guess.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Breakdown:
    """Seconds by phase; a phase entered twice adds up. Safe to use from several threads."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            return {k: round(v, 6) for k, v in self.seconds.items()}
