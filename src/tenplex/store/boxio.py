"""Moving the bytes of a box out of a blob: into a caller's array (same host) or onto a socket (network).

A box of a C-order blob is contiguous when it only narrows the leading dimensions; then it is copied or sent
straight from the blob's memory. Other boxes go through a reusable buffer in slabs, so the daemon never
allocates per request and the client never sees a `bytes` object.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..ptc import Box
from .checksum import CHUNK, byte_span, verify_chunk, verify_span
from .keys import NUMPY_DTYPE

SCRATCH = 8 << 20  # bytes of the per-connection buffer for strided boxes
SLAB = 2 * CHUNK  # bytes of the blob a strided copy verifies and copies at a time


def blob_array(buf: memoryview | bytearray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The blob's memory as an ndarray (no copy)."""
    return np.frombuffer(buf, dtype=NUMPY_DTYPE[dtype], count=math.prod(shape)).reshape(shape)


def as_bytes(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


def pieces(view: np.ndarray, scratch: np.ndarray) -> Iterator[memoryview]:
    """The bytes of `view` in C order as a few memoryviews: slices of the blob or of `scratch` (reused)."""
    if view.size == 0:
        return
    if view.flags.c_contiguous:
        yield as_bytes(view)
        return
    row = view[0].nbytes if view.ndim > 1 else view.itemsize
    if view.ndim > 1 and row > scratch.nbytes:
        for sub in view:  # one row does not fit: go one dimension deeper
            yield from pieces(sub, scratch)
        return
    rows = max(1, scratch.nbytes // row)
    flat = scratch.view(np.uint8)
    for i in range(0, view.shape[0], rows):
        slab = view[i : i + rows]
        if slab.flags.c_contiguous:
            yield as_bytes(slab)
            continue
        dst = flat[: slab.nbytes].view(view.dtype).reshape(slab.shape)
        np.copyto(dst, slab)
        yield memoryview(flat[: slab.nbytes])


def copy_box(
    data: memoryview,
    digests: list[int],
    dtype: str,
    shape: tuple[int, ...],
    box: Box,
    out: np.ndarray,
    what: str,
) -> None:
    """Verify the chunks `box` touches and copy it into `out`; contiguous boxes chunk by chunk (in cache)."""
    arr = blob_array(data, dtype, shape)
    view = arr[box.slices()]
    lo, hi = byte_span(box, shape, arr.itemsize)
    if not view.flags.c_contiguous:
        # in slabs of leading rows, each copied right after the chunks under it were verified (while they are
        # in cache), rather than hashing the whole span first and reading it from memory again
        rows = max(1, SLAB // arr.strides[0])
        checked = lo // CHUNK  # chunks before this one are verified
        first, rest = box.start[0], (box.start[1:], box.stop[1:])
        for i in range(0, view.shape[0], rows):
            j = min(i + rows, view.shape[0])
            _, end = byte_span(Box((first + i, *rest[0]), (first + j, *rest[1])), shape, arr.itemsize)
            verify_span(data, digests, checked * CHUNK, end, what)
            checked = max(checked, (end - 1) // CHUNK + 1)
            np.copyto(out[i:j], view[i:j])
        return
    dst = as_bytes(out)
    for c in range(lo // CHUNK, (hi - 1) // CHUNK + 1 if hi > lo else 0):
        verify_chunk(data, digests, c, what)
        s, e = max(c * CHUNK, lo), min((c + 1) * CHUNK, hi)
        dst[s - lo : e - lo] = data[s:e]
