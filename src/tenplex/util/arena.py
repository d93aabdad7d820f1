"""One huge-page mapping carved into many scratch buffers.

Why: a load lands every box in fresh scratch memory first (its targets are written only once every box
arrived and verified). Fresh memory on 4 KiB pages costs a fault and a zeroed page per 4 KiB, and most
kernels give transparent huge pages only to memory that asks for them (`enabled = madvise`). numpy asks
for buffers of 4 MiB and more, `torch.empty` never does, and a model's state is mostly tensors under
4 MiB, so a copy into fresh `torch.empty` memory pays a fault per 4 KiB page that a copy into an advised
buffer pays per 2 MiB. One advised mapping for all of a load's buffers gives every
tensor huge pages, small ones included, and is unmapped when its last view goes.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20
ALIGN = 64  # every buffer starts on a cache line
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


class Arena:
    """`take` hands out consecutive, disjoint byte buffers of one mapping of `capacity` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        size = _round(max(capacity, 1), ALIGN) + HUGE_PAGE
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if _ADVICE is not None:
            try:
                region.madvise(_ADVICE)
            except OSError:  # huge pages off for this kernel or process: 4 KiB pages still work
                pass
        raw = np.frombuffer(region, np.uint8)  # every view keeps `region` mapped
        skip = -raw.ctypes.data % HUGE_PAGE
        self._raw = raw[skip : skip + _round(max(capacity, 1), ALIGN)]

    @staticmethod
    def size_of(nbytes: list[int]) -> int:
        """The capacity that `take`s of these sizes need."""
        return sum(_round(n, ALIGN) for n in nbytes)

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` uninitialized bytes no other `take` of this arena overlaps."""
        end = self.used + nbytes
        if end > self.capacity:
            raise ValueError(
                f"arena of {self.capacity} bytes has {self.capacity - self.used} left, {nbytes} asked"
            )
        out = self._raw[self.used : end]
        self.used = _round(end, ALIGN)
        return out
