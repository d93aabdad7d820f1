"""A client's same-host side: blobs read and written through this process's own mappings of the store's
shared-memory files, located and held by the daemon while they are in use, verified on every read."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ..ptc import Box
from .boxio import blob_array, copy_box
from .checksum import CHUNK, byte_span, verify_span
from .errors import BadRequestError, StoreError
from .keys import check_dtype, check_inside, check_name, check_out, version_path
from .mappings import Mappings
from .shm import map_file, populate
from .transport import Transport

Item = tuple[str, Box, str]  # (blob name, box, expected dtype)


class Held:
    """Verified boxes in a same-host store's memory (read-only views), and the hold on their blobs."""

    def __init__(self, arrays: list[np.ndarray], release: Callable[[], None]) -> None:
        self.arrays = arrays
        self._release: Callable[[], None] | None = release

    def close(self) -> None:
        """End the hold (once); the views must not be used after it."""
        release, self._release = self._release, None
        if release is not None:
            release()


class SameHost:
    """Blobs of a store on this host, in this process's cached mappings of its files (`maps`)."""

    def __init__(self, transport: Transport, maps: Mappings) -> None:
        self.transport = transport
        self.maps = maps

    def check_holdable(self, items: Sequence[Item], instead: str) -> None:
        """Refuse a hold from a store not on this host (`instead`: what to call then) or of bad names."""
        if not self.transport.is_local:
            raise BadRequestError(f"{self.transport.url} is not on this host: {instead}")
        for name, _, dtype in items:
            check_name(name)
            check_dtype(dtype)

    def map(self, info: dict[str, Any], writable: bool = False) -> memoryview:
        """A blob's bytes in a cached mapping of its file (see `mappings`): a file of its own mapped whole;
        a pack or the store's reserve mapped whole once, unpopulated, and each blob's range populated when
        handed out."""
        path, nbytes, at, span = info["path"], info["nbytes"], info["offset"], info["span"]
        whole = at == 0 and span == nbytes
        mem = self.maps.get((path, span, writable), lambda: map_file(path, span, writable, populate=whole))
        if whole:
            return memoryview(mem)
        if not 0 <= at <= at + nbytes <= span:
            raise StoreError(f"the store placed a blob of {nbytes} bytes at {at} in a file of {span}")
        populate(mem, at, nbytes, writable)
        return memoryview(mem)[at : at + nbytes]

    def locate(
        self, job: str, step: int, names: list[str], save_id: str | None
    ) -> tuple[dict[str, dict[str, Any]], Callable[[], None]]:
        """Where the blobs' files are, held by the daemon for this connection until the returned function
        ends the lease."""
        names = sorted(set(names))
        leased = self.transport.lease(
            "POST", f"{version_path(job, step)}/locate", {"names": names, "save_id": save_id}
        )
        return dict(zip(names, leased.answer["blobs"])), partial(self.transport.end_lease, leased)

    def copy(self, info: dict[str, Any], box: Box, out: np.ndarray, what: str) -> None:
        """Copy `box` of a located blob into `out`, its chunks verified on the way."""
        check_inside(box, tuple(info["shape"]))
        dst = check_out(out, info["dtype"], box)
        _check_chunk(info)
        copy_box(self.map(info), info["digests"], info["dtype"], tuple(info["shape"]), box, dst, what)

    def held(
        self, infos: list[dict[str, Any]], items: Sequence[Item], release: Callable[[], None], where: str
    ) -> Held:
        """Verified views of (blob, box, dtype) of located blobs, held until `release`; on any error the
        hold ends before it is raised."""
        held = Held([], release)
        try:
            for info, (name, box, dtype) in zip(infos, items, strict=True):
                held.arrays.append(self.verified_view(info, box, dtype, f"{where}/{name}"))
        except BaseException:
            held.close()
            raise
        return held

    def verified_view(self, info: dict[str, Any], box: Box, dtype: str, what: str) -> np.ndarray:
        """A read-only view of `box` of a located blob, its chunks verified; refuses another dtype (as
        check_out does for a copy: bytes are never reinterpreted)."""
        if info["dtype"] != dtype:
            raise BadRequestError(f"{what} holds {info['dtype']}, {dtype} expected")
        shape = tuple(info["shape"])
        check_inside(box, shape)
        _check_chunk(info)
        data = self.map(info)
        arr = blob_array(data, dtype, shape)
        lo, hi = byte_span(box, shape, arr.itemsize)
        verify_span(data, info["digests"], lo, hi, what)
        return arr[(*box.slices(), ...)]  # read-only: the mapping is


def _check_chunk(info: dict[str, Any]) -> None:
    if info["chunk"] != CHUNK:
        raise StoreError(f"store uses {info['chunk']}-byte checksum chunks, this client {CHUNK}")
