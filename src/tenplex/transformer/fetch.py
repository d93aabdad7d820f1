"""Executing one rank's part of a plan: pull every box into the rank's tensors.

Boxes on this host come through shared memory; boxes of other hosts come through this host's store, which
fetches each remote box once and serves it to every local rank that needs it (the planner's lower bound).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..planner import Fetch, Plan, Route
from ..ptc import PTC, Box
from ..store import Held, MemoryLimitError, StoreClient, StoreError, hold_relayed_many, read_many, relay_many
from ..store.keys import NUMPY_DTYPE
from ..util.arena import Arena
from .breakdown import Breakdown
from .errors import StateError
from .gathered import blob_name
from .shards import VIEW_AS, LocalShard, Staged, as_numpy, copy_into
from .stores import client


def shared_remote_boxes(p: Plan, host: str) -> set[tuple[str, Any, int]]:
    """(tensor, box, source rank) that more than one rank of `host` pulls from another host: those go
    through the host's store (fetched once, served to each) whatever their target; a box one rank alone
    needs goes there too for a CPU target (`_relays_to_cpu`), else it is read directly."""
    out = set()
    for g in p.groups:
        for m in g.moves:
            if m.route is Route.RELAYED and p.new.mesh.hosts[m.dst] == host:
                out.update((t, m.box, m.src) for t in g.tensors)
    return out


def execute(
    fetches: list[Fetch],
    shards: dict[str, LocalShard],
    job: str,
    step: int,
    old: PTC,
    url: str,
    central: bool,
    concurrency: int,
    shared: set[tuple[str, Any, int]],
    bd: Breakdown,
    save_id: str | None = None,
) -> tuple[dict[str, int], Callable[[], None], Callable[[], None]]:
    """Pull or verify every box of this rank; returns the bytes moved by route, the function that writes
    the targets (the caller calls it once every rank's boxes arrived and verified: a failed load leaves
    every target as it was) and the one that lets go of the boxes held in this host's store (always
    called, after the write or instead of it).

    A box in this host's store is verified where it lies and held there, and the write copies it straight
    into a CPU target: no scratch memory, whose first touch is what costs. A box from another host for a
    CPU target is fetched into this host's store (once, however many local ranks need it) and held there
    the same way; when that store has no room, and for accelerator targets, it lands in scratch:
    contiguous in its tensor, in a scratch copy of the tensor, written in one copy; otherwise in a buffer
    of its own, copied into the target's view. Boxes read from one store are batched (one lookup on this
    host, one request over the network per batch) and the stores are read in parallel. Every read names
    the snapshot's `save_id`, so a store holding another save of the step answers NotFound instead of that
    save's bytes."""
    hub: StoreClient | None = client(old.mesh.hosts[0]) if central else None
    own = client(url)
    sources = {
        (n, r): piece.box
        for n in {f.tensor for f in fetches}
        for piece in old.pieces(n)
        for r in piece.holders
    }
    moved: dict[str, int] = {"central": 0} if central else {r.value: 0 for r in Route}
    routed = []  # (fetch, box in its source blob, store client, peer url for a relay or None)
    for f in fetches:
        src_box = f.box.relative_to(sources[(f.tensor, f.src)])
        src_url = old.mesh.hosts[f.src]
        if hub is not None:
            routed.append((f, src_box, hub, None if src_url == hub.url else src_url))
        elif src_url == url:
            routed.append((f, src_box, own, None))
        elif (f.tensor, f.box, f.src) in shared or _relays_to_cpu(own, client(src_url), shards[f.tensor]):
            routed.append((f, src_box, own, src_url))  # into this host's store: fetched once, held there
        else:
            routed.append((f, src_box, client(src_url), None))
        moved["central" if central else f.route.value] += f.box.volume * old.tensors[f.tensor].itemsize

    def in_place(f: Fetch, c: StoreClient) -> bool:
        return c.is_local and shards[f.tensor].local.device.type == "cpu"

    held_here = [(f, b, c) for f, b, c, peer in routed if peer is None and in_place(f, c)]
    held_relayed = [(f, b, c, peer) for f, b, c, peer in routed if peer is not None and in_place(f, c)]
    pulled = [(f, b, c, peer) for f, b, c, peer in routed if not in_place(f, c)]
    rels = [f.box.relative_to(shards[f.tensor].box) for f, *_ in pulled]
    runs = [_contiguous(rel, shards[f.tensor].box.shape) for (f, *_), rel in zip(pulled, rels)]
    inplace = sorted({f.tensor for (f, *_), run in zip(pulled, runs) if run})
    dtypes = {n: np.dtype(NUMPY_DTYPE[shards[n].dtype]) for n in {f.tensor for f, *_ in pulled}}
    arena = Arena(Arena.size_of(
        [shards[n].local.nbytes for n in inplace]
        + [rel.volume * dtypes[f.tensor].itemsize for (f, *_), rel, run in zip(pulled, rels, runs) if not run]
    ))  # fmt: skip
    staged = {n: Staged(shards[n].local, fill=False, scratch=arena) for n in inplace}
    network: list[tuple[StoreClient, str, int, str, Any, np.ndarray]] = []
    copies: list[tuple[StoreClient, str, int, str, Any, np.ndarray]] = []  # this host's, to a GPU target
    relayed: list[tuple[StoreClient, str, str, Any, np.ndarray]] = []
    apart: list[tuple[torch.Tensor, np.ndarray]] = []  # (the target's view, the box's own buffer)
    for (f, src_box, c, peer), rel, run in zip(pulled, rels, runs):
        if run:
            out = staged[f.tensor].array[(*rel.slices(), ...)]
        else:
            out = arena.take(rel.volume * dtypes[f.tensor].itemsize).view(dtypes[f.tensor]).reshape(rel.shape)
            apart.append((shards[f.tensor].local[rel.slices()], out))
        blob = blob_name(f.src, f.tensor)
        if peer is not None:
            relayed.append((c, peer, blob, src_box, out))
        else:
            (copies if c.is_local else network).append((c, job, step, blob, src_box, out))
    by_store: dict[int, tuple[StoreClient, list[tuple[Fetch, Box]]]] = {}
    for f, src_box, c in held_here:
        by_store.setdefault(id(c), (c, []))[1].append((f, src_box))
    holds: list[tuple[Held, list[tuple[Fetch, Box]]]] = []  # each hold with the fetches it serves

    def hold() -> None:
        read_many(copies, concurrency, save_id)
        for c, boxes in by_store.values():
            asked = [(blob_name(f.src, f.tensor), b, shards[f.tensor].dtype) for f, b in boxes]
            holds.append((c.hold_boxes(job, step, asked, save_id), boxes))

    def hold_relays() -> None:
        relay_many(relayed, job, step, concurrency, save_id)
        asked = [(c, peer, blob_name(f.src, f.tensor), b, shards[f.tensor].dtype)
                 for f, b, c, peer in held_relayed]  # fmt: skip
        try:
            made = hold_relayed_many(asked, job, step, concurrency, save_id)
        except MemoryLimitError:  # no room in this host's store: the boxes land in scratch instead
            read_many(_into_scratch(held_relayed, shards, apart, job, step), concurrency, save_id)
            return
        for h, which in made:
            holds.append((h, [held_relayed[i][:2] for i in which]))

    kinds = [("shm_reads", held_here + copies, hold),
             ("relayed_reads", relayed + held_relayed, hold_relays),
             ("network_reads", network, lambda: read_many(network, concurrency, save_id))]  # fmt: skip

    def release() -> None:
        for h, _ in holds:
            h.close()

    try:
        with bd.phase("reads"), ThreadPoolExecutor(max_workers=3) as pool:
            futures = [pool.submit(_timed, bd, kind, fn) for kind, work, fn in kinds if work]
            for fut in futures:
                fut.result()
    except StoreError as e:
        release()
        raise StateError(f"loading the snapshot of {job!r} at step {step}: {e}") from e
    except BaseException:
        release()
        raise

    def write() -> None:
        for st in staged.values():  # first whole tensors, then the boxes over them
            st.finish()
        for view, buf in apart:
            src = torch.from_numpy(buf)
            copy_into(view, src.view(view.dtype) if view.dtype in VIEW_AS else src)
        for h, boxes in holds:  # dtypes checked by hold_boxes
            for (f, _), arr in zip(boxes, h.arrays):
                dst = as_numpy(shards[f.tensor].local[f.box.relative_to(shards[f.tensor].box).slices()])
                np.copyto(dst, arr.view(dst.dtype), casting="no")  # bfloat16: uint16 on both sides

    return moved, write, release


def _relays_to_cpu(own: StoreClient, src: StoreClient, shard: LocalShard) -> bool:
    """Whether a box of another host's store goes through this host's store even if one rank alone needs
    it: for a CPU target, when this host's store is reachable through shared memory. There the box lands in
    memory the store has taken already (pooled, reserved) and is held until the write; in scratch memory
    it would pay a first touch of fresh pages, which on this VM ran at 0.1-1.5 GB/s (the full-size dp
    change over two hosts spent 6.2 s in its network reads of 0.6 GB per rank)."""
    return own.is_local and not src.is_local and shard.local.device.type == "cpu"


def _into_scratch(
    relayed: list[tuple[Fetch, Box, StoreClient, str]],
    shards: dict[str, LocalShard],
    apart: list[tuple[torch.Tensor, np.ndarray]],
    job: str,
    step: int,
) -> list[tuple[StoreClient, str, int, str, Box, np.ndarray]]:
    """Direct reads from the peers of boxes meant to be relayed, each into a scratch buffer of its own
    (added to `apart`, which the write copies into the targets)."""
    dtype = {n: np.dtype(NUMPY_DTYPE[shards[n].dtype]) for n in {f.tensor for f, *_ in relayed}}
    arena = Arena(Arena.size_of([f.box.volume * dtype[f.tensor].itemsize for f, *_ in relayed]))
    reads = []
    for f, src_box, _, peer in relayed:
        out = arena.take(f.box.volume * dtype[f.tensor].itemsize).view(dtype[f.tensor]).reshape(f.box.shape)
        apart.append((shards[f.tensor].local[f.box.relative_to(shards[f.tensor].box).slices()], out))
        reads.append((client(peer), job, step, blob_name(f.src, f.tensor), src_box, out))
    return reads


def _contiguous(box: Box, shape: tuple[int, ...]) -> bool:
    """Whether `box` of a C-order array of `shape` is one contiguous run (it narrows only the leading
    dimension, after any dimensions it takes one index of)."""
    d = 0
    while d < len(shape) - 1 and box.stop[d] - box.start[d] == 1:
        d += 1
    return all(box.start[k] == 0 and box.stop[k] == shape[k] for k in range(d + 1, len(shape)))


def _timed(bd: Breakdown, kind: str, fn: Callable[[], None]) -> None:
    with bd.phase(kind):
        fn()


def drop_relays(job: str, step: int, url: str, stores: list[str], me: int) -> None:
    """The lowest rank of each store frees that store's relay cache once everyone has loaded
    (`stores`: each rank's store), without waiting for the answer: the pieces still held are freed when
    their holds end, and nothing waits on the drop."""
    if stores.index(url) == me:
        try:
            client(url).drop_relay(job, step, wait=False)
        except StoreError:
            pass
