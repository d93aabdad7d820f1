"""Python's cyclic garbage collector kept off the short calls that must be fast.

A full collection walks every tracked object of the process (torch alone brings hundreds of thousands),
and a rank that holds a model and a plan has more. In the reconfiguration benchmark's ranks
(`benchmarks/bench_reconfig.py`, `results/bench_reconfig.json`: the load's phases) the planner's
allocations set one off inside a load often enough to make it the load's slowest phase. Save and load
make almost no cycles (their objects are freed by reference counting), so the collector has nothing to
find there; it waits until they return.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside; a caller that had turned the collector off keeps it off. Nested or
    concurrent pauses end at the latest when the first one that found the collector on ends."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_imports() -> None:
    """Move every object alive now (the imported modules) out of the collector's reach, for good: a process
    about to fork its ranks does this once, so their full collections walk only their own objects (and do
    not write into the pages they share copy-on-write)."""
    gc.collect()
    gc.freeze()
