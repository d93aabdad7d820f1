"""Python's cyclic garbage collector kept off the short calls that must be fast.

A full collection walks every tracked object of the process: with torch imported that is some 250 000,
and a rank that holds a model and a plan has more. Measured in the reconfiguration benchmark's ranks (4
ranks on 2 cores), one full collection took 0.17-0.53 s, and the planner's allocations set one off inside
a load often enough to be its slowest phase. Save and load make almost no cycles (their objects are freed
by reference counting), so the collector has nothing to find there; it waits until they return.
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
