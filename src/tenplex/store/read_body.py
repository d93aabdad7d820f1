"""The raw answer of a read, and the client's receiver of it: a length-prefixed JSON description of the
parts (`PREAMBLE`), the parts' bytes, then (when the store sends checksums) one xxh3-64 per chunk piece.

The parts are received straight into the caller's arrays and each piece hashed as it lands, so no copy
and no second pass over the bytes stands between the socket and the caller's memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ..ptc import ITEM_SIZE, Box
from .boxio import as_bytes
from .checksum import CHUNK, cuts, digest
from .errors import ChecksumError, StoreError
from .keys import check_out
from .protocol import Conn

PREAMBLE = struct.Struct("<Q")  # length of the JSON part description that precedes raw read bodies
T = TypeVar("T")
Reader = Callable[[Conn, dict[str, str], int], T]


def into(outs: list[np.ndarray], sums: dict[int, list[int]] | None = None) -> Reader[None]:
    """A response reader that receives the raw parts of a read straight into `outs`, hashing each piece
    as it lands and checking it against the checksums the store sends after the parts (when it does).

    The store sends the saved checksums of the whole chunks a box covers, so this check is the one that
    catches bytes corrupted in the store's memory as well as on the way. With `sums`, each `out` whose
    part starts on a chunk boundary gets its verified checksums there (by `id(out)`): they are that
    array's own chunk checksums, which a store keeping the bytes need not compute again."""

    def read(conn: Conn, headers: dict[str, str], length: int) -> None:
        head = bytearray(PREAMBLE.size)
        conn.read_into(memoryview(head))
        (n,) = PREAMBLE.unpack(head)
        meta = json.loads(conn.read_bytes(n))
        left = length - PREAMBLE.size - n
        try:
            views, pieces = _layout(meta, outs, left)
        except StoreError:
            conn.drain(left)
            raise
        if pieces is None:  # no checksums sent
            for v in views:
                conn.read_into(v)
            return
        got = _receive_hashed(conn, views, pieces)
        if sums is not None:
            _keep_sums(sums, meta["parts"], outs, pieces, got)

    return read


def _layout(
    meta: dict[str, Any], outs: list[np.ndarray], left: int
) -> tuple[list[memoryview], list[list[tuple[int, int]]] | None]:
    """The byte views of `outs` the parts land in, checked against what the store announced, and where
    each view is cut to be hashed (None when the store sends no checksums)."""
    checked = "digests" in meta
    views, pieces = [], []
    for part, out in zip(meta["parts"], outs, strict=True):
        dt = part["dtype"]
        if dt not in ITEM_SIZE:
            raise StoreError(f"store answered with unknown dtype {dt!r}")
        views.append(as_bytes(check_out(out, dt, Box.full(tuple(out.shape)))))
        if len(views[-1]) != part["nbytes"]:
            raise StoreError(f"store answered {part['nbytes']} bytes for a {len(views[-1])}-byte box")
        if checked:
            pieces.append(cuts(len(views[-1]), int(part.get("skew", 0))))
    if not checked:
        return views, None
    count = sum(len(p) for p in pieces)
    if meta["digests"] != count or left != sum(map(len, views)) + 8 * count:
        raise StoreError("store answered a read with a malformed checksum trailer")
    return views, pieces


def _receive_hashed(conn: Conn, views: list[memoryview], pieces: list[list[tuple[int, int]]]) -> list[int]:
    """Receive the parts a chunk's worth at a time (small pieces together, in one scatter read), each
    piece hashed right after its group arrived (while it is in cache), then the trailer; the pieces'
    checksums once they match it."""
    got: list[int] = []
    group: list[memoryview] = []
    size = 0
    for v, cut in zip(views, pieces):
        for a, b in cut:
            if group and size + b - a > CHUNK:
                _receive_group(conn, group, got)
                size = 0
            group.append(v[a:b])
            size += b - a
    _receive_group(conn, group, got)
    trailer = bytearray(8 * len(got))
    conn.read_into(memoryview(trailer))
    sent = list(struct.unpack(f"<{len(got)}Q", trailer))
    if sent != got:
        raise ChecksumError(_mismatch(sent, got, pieces))
    return got


def _receive_group(conn: Conn, group: list[memoryview], got: list[int]) -> None:
    conn.read_many_into(group)
    got.extend(digest(v) for v in group)
    group.clear()


def _keep_sums(
    sums: dict[int, list[int]],
    parts: list[dict[str, Any]],
    outs: list[np.ndarray],
    pieces: list[list[tuple[int, int]]],
    got: list[int],
) -> None:
    """The verified checksums of every out whose part starts on a chunk boundary, by `id(out)`."""
    at = 0
    for part, out, cut in zip(parts, outs, pieces):
        if not int(part.get("skew", 0)):
            sums[id(out)] = got[at : at + len(cut)]
        at += len(cut)


def _mismatch(sent: list[int], got: list[int], pieces: list[list[tuple[int, int]]]) -> str:
    """Which part and bytes of a read failed their checksum."""
    first = next(i for i, (a, b) in enumerate(zip(sent, got)) if a != b)
    for k, cut in enumerate(pieces):
        if first < len(cut):
            lo, hi = cut[first]
            return (f"a read's bytes {lo}..{hi} of box {k} do not match the store's checksums (corrupted in "
                    "the store's memory or on the way): not returned")  # fmt: skip
        first -= len(cut)
    raise AssertionError("unreachable")
