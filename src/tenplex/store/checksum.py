"""Per-chunk xxh3-64 checksums: a box read verifies only the chunks it touches, so small reads stay cheap."""

from __future__ import annotations

import xxhash

from ..ptc import Box
from .errors import ChecksumError

CHUNK = 1 << 20  # bytes per checksum; xxh3 hashes ~15 GB/s here, so a touched chunk costs ~70 µs


def digest(data: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def chunks(data: memoryview, chunk: int = CHUNK) -> list[memoryview]:
    """Consecutive `chunk`-byte pieces of `data` (the last may be shorter): the unit of every checksum."""
    return [data[i : i + chunk] for i in range(0, len(data), chunk)]


def chunk_digests(data: memoryview, chunk: int = CHUNK) -> list[int]:
    """Checksums of consecutive `chunk`-byte pieces of `data` (the last may be shorter)."""
    return [digest(p) for p in chunks(data, chunk)]


def verify_chunk(data: memoryview, digests: list[int], c: int, what: str, chunk: int = CHUNK) -> None:
    """Raise ChecksumError when chunk `c` of `data` does not match its checksum."""
    if digest(data[c * chunk : (c + 1) * chunk]) != digests[c]:
        raise ChecksumError(f"{what}: bytes {c * chunk}..{min((c + 1) * chunk, len(data))} are corrupted")


def byte_span(box: Box, shape: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """The `[first, last)` byte range of a C-order blob that holds every element of `box`."""
    if box.empty:
        return 0, 0
    first = last = 0
    for a, b, n in zip(box.start, box.stop, shape):
        first = first * n + a
        last = last * n + (b - 1)
    return first * itemsize, (last + 1) * itemsize


def verify_span(
    data: memoryview, digests: list[int], lo: int, hi: int, what: str, chunk: int = CHUNK
) -> None:
    """Raise ChecksumError when a chunk overlapping bytes `[lo, hi)` does not match its checksum."""
    if hi <= lo:
        return
    for c in range(lo // chunk, (hi - 1) // chunk + 1):
        verify_chunk(data, digests, c, what, chunk)
