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
from ..store import StoreClient, StoreError, read_many, relay_many
from ..store.keys import NUMPY_DTYPE
from ..util.arena import Arena
from .breakdown import Breakdown
from .errors import StateError
from .gathered import blob_name
from .shards import VIEW_AS, LocalShard, Staged, copy_into
from .stores import client


def shared_remote_boxes(p: Plan, host: str) -> set[tuple[str, Any, int]]:
    """(tensor, box, source rank) that more than one rank of `host` pulls from another host: only those go
    through the host's store (fetched once, served to each); a box one rank alone needs is read directly."""
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
) -> tuple[dict[str, int], Callable[[], None]]:
    """Pull every box of this rank into scratch buffers; returns the bytes moved by route and the function
    that writes the targets (the caller calls it once every rank's boxes arrived and verified: a failed load
    leaves every target as it was).

    A box contiguous in its tensor lands in a scratch copy of the tensor, written to it in one copy; any
    other box lands in a buffer of its own and is copied straight into the target's view (not first into
    the scratch). Boxes read from one store are batched (one lookup on this host, one request over the
    network per batch) and the stores are read in parallel; boxes several local ranks need from another
    host go through this host's store, which fetches each once. Every read names the snapshot's `save_id`,
    so a store holding another save of the step answers NotFound instead of that save's bytes."""
    names = sorted({f.tensor for f in fetches})
    rels = [f.box.relative_to(shards[f.tensor].box) for f in fetches]
    runs = [_contiguous(rel, shards[f.tensor].box.shape) for f, rel in zip(fetches, rels)]
    inplace = sorted({f.tensor for f, run in zip(fetches, runs) if run})
    dtypes = {n: np.dtype(NUMPY_DTYPE[shards[n].dtype]) for n in names}
    arena = Arena(Arena.size_of(
        [shards[n].local.nbytes for n in inplace]
        + [rel.volume * dtypes[f.tensor].itemsize for f, rel, run in zip(fetches, rels, runs) if not run]
    ))  # fmt: skip
    staged = {n: Staged(shards[n].local, fill=False, scratch=arena) for n in inplace}
    own = client(url)
    hub: StoreClient | None = client(old.mesh.hosts[0]) if central else None
    sources = {(name, r): piece.box for name in names for piece in old.pieces(name) for r in piece.holders}
    moved: dict[str, int] = {"central": 0} if central else {r.value: 0 for r in Route}
    direct: list[tuple[StoreClient, str, int, str, Any, np.ndarray]] = []
    relayed: list[tuple[StoreClient, str, str, Any, np.ndarray]] = []
    apart: list[tuple[torch.Tensor, np.ndarray]] = []  # (the target's view, the box's own buffer)
    for f, rel, run in zip(fetches, rels, runs):
        if run:
            out = staged[f.tensor].array[(*rel.slices(), ...)]
        else:
            local = shards[f.tensor].local
            out = arena.take(rel.volume * dtypes[f.tensor].itemsize).view(dtypes[f.tensor]).reshape(rel.shape)
            apart.append((local[rel.slices()], out))
        src_box = f.box.relative_to(sources[(f.tensor, f.src)])
        src_url, blob = old.mesh.hosts[f.src], blob_name(f.src, f.tensor)
        if hub is not None:
            if src_url == hub.url:
                direct.append((hub, job, step, blob, src_box, out))
            else:
                relayed.append((hub, src_url, blob, src_box, out))
        elif src_url == url:
            direct.append((own, job, step, blob, src_box, out))
        elif (f.tensor, f.box, f.src) in shared:
            relayed.append((own, src_url, blob, src_box, out))
        else:
            direct.append((client(src_url), job, step, blob, src_box, out))
        moved["central" if central else f.route.value] += f.box.volume * old.tensors[f.tensor].itemsize
    shm = [d for d in direct if d[0].is_local]
    network = [d for d in direct if not d[0].is_local]

    kinds = [("shm_reads", shm, lambda: read_many(shm, concurrency, save_id)),
             ("relayed_reads", relayed, lambda: relay_many(relayed, job, step, concurrency, save_id)),
             ("network_reads", network, lambda: read_many(network, concurrency, save_id))]  # fmt: skip
    try:
        with bd.phase("reads"), ThreadPoolExecutor(max_workers=3) as pool:
            futures = [pool.submit(_timed, bd, kind, fn) for kind, work, fn in kinds if work]
            for fut in futures:
                fut.result()
    except StoreError as e:
        raise StateError(f"loading the snapshot of {job!r} at step {step}: {e}") from e

    def write() -> None:
        for st in staged.values():  # first whole tensors, then the boxes held apart over them
            st.finish()
        for view, buf in apart:
            src = torch.from_numpy(buf)
            copy_into(view, src.view(view.dtype) if view.dtype in VIEW_AS else src)

    return moved, write


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
    (`stores`: each rank's store)."""
    if stores.index(url) == me:
        try:
            client(url).drop_relay(job, step)
        except StoreError:
            pass
