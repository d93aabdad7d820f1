"""Per-chunk xxh3-64 checksums: a box read verifies only the chunks it touches, so small reads stay cheap."""

from __future__ import annotations

import xxhash

from ..ptc import Box
from .errors import ChecksumError

CHUNK = 1 << 20  # bytes per checksum: a box touching a chunk hashes all of it (rate: `checksum_GBps`,
# results/bench_reconfig.json, from `python benchmarks/bench_reconfig.py`)


def digest(data: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def chunks(data: memoryview, chunk: int = CHUNK) -> list[memoryview]:
    """Consecutive `chunk`-byte pieces of `data` (the last may be shorter): the unit of every checksum."""
    return [data[i : i + chunk] for i in range(0, len(data), chunk)]


def chunk_digests(data: memoryview, chunk: int = CHUNK) -> list[int]:
    """Checksums of consecutive `chunk`-byte pieces of `data` (the last may be shorter)."""
    return [digest(p) for p in chunks(data, chunk)]


def copy_hashed(src: memoryview, dst: memoryview, chunk: int = CHUNK) -> list[int]:
    """Copy `src` into `dst`, hashing each chunk right after it is copied, while it is in cache: a save's
    checksums without a second pass over the bytes."""
    digests = []
    for i in range(0, len(src), chunk):
        dst[i : i + chunk] = src[i : i + chunk]
        digests.append(digest(dst[i : i + chunk]))
    return digests


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


def verify_edges(
    data: memoryview, digests: list[int], lo: int, hi: int, what: str, chunk: int = CHUNK
) -> None:
    """Raise ChecksumError when a chunk that `[lo, hi)` covers only in part does not match its checksum.

    Why only those: a network read sends the stored checksums of the whole chunks it covers, and the
    receiver checks the bytes against them, so corruption there is caught on arrival without a pass over
    the bytes here; the partial chunks at either end travel with fresh checksums (`span_digests`), which
    must be computed over verified bytes."""
    if hi <= lo:
        return
    for c in sorted({lo // chunk, (hi - 1) // chunk}):
        s, e = c * chunk, min((c + 1) * chunk, len(data))
        if lo > s or hi < e:
            verify_chunk(data, digests, c, what, chunk)


def list_digest(digests: list[int]) -> int:
    """One checksum of a blob's chunk checksums: what a writer sends so the store can refuse other bytes."""
    return digest(memoryview(b"".join(d.to_bytes(8, "little") for d in digests)))


# ---- a read answer's own checksums: the receiver verifies what arrived, whatever happened on the way.
# A part's byte stream is cut where (position + skew) % CHUNK == 0; for a contiguous box `skew` is its
# offset in its first chunk, so every whole chunk it covers is one piece whose checksum is the stored one.


def cuts(n: int, skew: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """The `[start, stop)` pieces of an `n`-byte part stream whose first piece is `skew` bytes short."""
    out, pos = [], 0
    while pos < n:
        end = min(n, pos + chunk - (pos + skew) % chunk)
        out.append((pos, end))
        pos = end
    return out


def span_digests(data: memoryview, digests: list[int], lo: int, hi: int, chunk: int = CHUNK) -> list[int]:
    """Checksums of the pieces of the contiguous stream `data[lo:hi]` (skew `lo % chunk`): the stored ones
    for whole chunks (already verified by the caller), fresh ones for the partial chunks at either end."""
    out = []
    for c in range(lo // chunk, (hi - 1) // chunk + 1 if hi > lo else 0):
        s, e = max(c * chunk, lo), min((c + 1) * chunk, hi)
        whole = s == c * chunk and e == min((c + 1) * chunk, len(data))
        out.append(digests[c] if whole else digest(data[s:e]))
    return out


class StreamDigests:
    """Checksums of a stream fed in pieces of any size, cut every `chunk` bytes (skew 0)."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk, self.digests = chunk, []
        self._h, self._fill = xxhash.xxh3_64(), 0

    def update(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            k = min(len(data) - pos, self.chunk - self._fill)
            self._h.update(data[pos : pos + k])
            pos, self._fill = pos + k, self._fill + k
            if self._fill == self.chunk:
                self.digests.append(self._h.intdigest())
                self._h.reset()
                self._fill = 0

    def finish(self) -> list[int]:
        if self._fill:
            self.digests.append(self._h.intdigest())
            self._h.reset()
            self._fill = 0
        return self.digests
