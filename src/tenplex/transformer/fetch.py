"""The executor: one rank's part of a plan as typed reads, held or staged, then written into the targets.

Boxes on this host come through shared memory. A box of another host that several ranks of this host need
comes through this host's store, which fetches it once and serves it to each of them (the planner's lower
bound); a box one rank alone needs, or a small one, is read straight from its store, in that store's batched
read, with no hop through this host's store.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache, partial
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from ..planner import Fetch, Plan, Route
from ..ptc import PTC, Box
from ..store import Held, MemoryLimitError, StoreClient, StoreError, hold_relayed_many, read_many, relay_many
from ..util.arena import Arena
from ..util.parallel import each
from .breakdown import Breakdown
from .errors import StateError
from .gathered import blob_name
from .shards import VIEW_AS, LocalShard, Staged, as_numpy, copy_into, host_resident
from .snapshot import Version
from .stores import client

# A box another local rank needs too, but smaller than this, is read directly by each rank that needs it: it
# rides in the batched read of the rank's other boxes from that store, where a relay costs this host's store
# a round trip to the peer and the rank a mapping of the piece (the `relayed_reads` phase of
# `python benchmarks/bench_peers.py --cases recovery`: the optimizer's step scalars).
RELAY_MIN_BYTES = 64 << 10


class Via(StrEnum):
    """How a read reaches its bytes. The planner's `Route` is what the plan counts (kept, same host,
    relayed, cross host); this is what travels: kept and same-host boxes alike come from this host's store."""

    SHM = "shm"  # a store on this host, through shared memory
    NETWORK = "network"  # another host's store, asked directly
    RELAY = "relay"  # another host's store through this host's: fetched once, served to each local rank


@dataclass(frozen=True, slots=True)
class Read:
    """One fetch of the plan as the executor runs it: `src_box` within its source blob, from `store`, which
    relays it from `peer` when one is named, into the shard keyed `target` (`tenplex.load`: the tensor's
    name; DCP: one shard per read item)."""

    fetch: Fetch
    target: str
    src_box: Box
    store: StoreClient
    peer: str | None = None

    @property
    def via(self) -> Via:
        if self.peer is not None:
            return Via.RELAY
        return Via.SHM if self.store.is_local else Via.NETWORK

    @property
    def blob(self) -> str:
        return blob_name(self.fetch.src, self.fetch.tensor)


def shared_remote_boxes(p: Plan, host: str, every: bool = False) -> set[tuple[str, Any, int]]:
    """(tensor, box, source rank) that more than one rank of `host` pulls from another host (`every`: any
    rank of it): those of at least `RELAY_MIN_BYTES` go through the host's store (fetched once, served to
    each, held where they land); any other remote box is read directly.

    Why `every` for a load that writes its targets only once all arrived (atomic): a box read directly
    lands in scratch memory first, whose pages the receive faults in one at a time, where the store
    receives into memory it holds already (the dp change onto a second host of
    `python benchmarks/bench_reconfig.py`, figures in docs/transformer.md). A load that lands boxes
    straight in their targets (not atomic) reads them directly: one hop, no copy."""
    routes = (Route.RELAYED, Route.CROSS_HOST) if every else (Route.RELAYED,)
    out = set()
    for g in p.groups:
        for m in g.moves:
            if m.route in routes and p.new.mesh.hosts[m.dst] == host:
                out.update((t, m.box, m.src) for t in g.tensors)
    return out


def routes(
    fetches: list[Fetch],
    old: PTC,
    url: str,
    *,
    central: bool,
    shared: set[tuple[str, Any, int]],
    target_of: Callable[[Fetch], str] = attrgetter("tensor"),
) -> list[Read]:
    """Each fetch of this rank as a read into the target `target_of(fetch)` (`url`: this rank's store; DCP's
    reader, whose targets are read items)."""
    hub = old.mesh.hosts[0] if central else None
    sources = {
        (n, r): piece.box
        for n in {f.tensor for f in fetches}
        for piece in old.pieces(n)
        for r in piece.holders
    }
    itemsize = {n: old.tensors[n].itemsize for n in {f.tensor for f in fetches}}
    store = cache(client)  # one lookup per store, not per box
    out = []
    for f in fetches:
        relay = (f.tensor, f.box, f.src) in shared and f.box.volume * itemsize[f.tensor] >= RELAY_MIN_BYTES
        at, peer = _source(url, old.mesh.hosts[f.src], hub, relay)
        out.append(Read(f, target_of(f), f.box.relative_to(sources[(f.tensor, f.src)]), store(at), peer))
    return out


def _source(url: str, src_url: str, hub: str | None, relay: bool) -> tuple[str, str | None]:
    """The store a read asks and the peer that store relays from: this host's store (`url`) when the source
    is on this host; through it when the box is to be relayed; else the source's store. With a `hub`, every
    read goes through the first old host's store (the paper's Tenplex-Central)."""
    if hub is not None:
        return hub, None if src_url == hub else src_url
    if src_url == url:
        return url, None
    return (url, src_url) if relay else (src_url, None)


@dataclass(frozen=True, slots=True)
class Way:
    """A move of the plan as its new rank reads it, the same for every tensor of the move's group (they
    share both placements): where the box lies in its source's blob, that source's store, and whether the
    reader's host relays it (`shared_remote_boxes`)."""

    box: Box
    src: int
    route: Route
    src_box: Box
    src_url: str
    shared: bool

    def __reduce__(self) -> tuple:  # its constructor call, as `Box`: the slotted default is slow
        return Way, (self.box, self.src, self.route, self.src_box, self.src_url, self.shared)


Ways = list[tuple[tuple[str, ...], tuple[Way, ...]]]  # one rank's part of a plan: per group, its moves


def ways(p: Plan, old: PTC, rank: int, shared: set[tuple[str, Any, int]]) -> Ways:
    """New rank `rank`'s part of `p`, group by group (`shared`: of its host). Why groups: a job's tensors
    fall in a few groups, so rank 0 plans every rank's part in a few steps per group instead of a few per
    tensor, and each rank unfolds its own (`reads_of`)."""
    out = []
    for g in p.groups:
        mine = [m for m in g.moves if m.dst == rank]
        if not mine:
            continue
        first = g.tensors[0]
        held = {r: piece.box for piece in old.pieces(first) for r in piece.holders}
        out.append((g.tensors, tuple(
            Way(m.box, m.src, m.route, m.box.relative_to(held[m.src]), old.mesh.hosts[m.src],
                (first, m.box, m.src) in shared)
            for m in mine
        )))  # fmt: skip
    return out


def reads_of(part: Ways, rank: int, url: str, shards: dict[str, LocalShard], hub: str | None) -> list[Read]:
    """This rank's part unfolded into its reads (`url`: its store; `hub`: Tenplex-Central's); a box's size,
    which decides a relay, from the target, whose dtype is the snapshot's."""
    store = cache(client)
    out = []
    for tensors, moves in part:
        for t in tensors:
            size = shards[t].array_dtype.itemsize
            for w in moves:
                f = Fetch(t, w.box, rank, w.src, w.route)
                at, peer = _source(url, w.src_url, hub, w.shared and w.box.volume * size >= RELAY_MIN_BYTES)
                out.append(Read(f, t, w.src_box, store(at), peer))
    return out


def moved_bytes(fetches: list[Fetch], shards: dict[str, LocalShard], central: bool) -> dict[str, int]:
    """The bytes this rank's fetches move, by the plan's route (all under "central" with `central`)."""
    moved: dict[str, int] = {"central": 0} if central else {r.value: 0 for r in Route}
    for f in fetches:
        moved["central" if central else f.route.value] += f.box.volume * shards[f.tensor].array_dtype.itemsize
    return moved


@dataclass
class _Requests:
    """Reads into scratch, as the store's batched calls take them."""

    copies: list[tuple[StoreClient, str, int, str, Box, np.ndarray]] = field(default_factory=list)  # on-host
    network: list[tuple[StoreClient, str, int, str, Box, np.ndarray]] = field(default_factory=list)
    relayed: list[tuple[StoreClient, str, str, Box, np.ndarray]] = field(default_factory=list)

    def add(self, r: Read, out: np.ndarray, at: Version) -> None:
        if r.peer is not None:
            self.relayed.append((r.store, r.peer, r.blob, r.src_box, out))
        else:
            (self.copies if r.store.is_local else self.network).append(
                (r.store, at.job, at.step, r.blob, r.src_box, out)
            )


class HeldBoxes:
    """One rank's boxes, verified and kept until the targets are written; a context manager that lets go of
    the boxes held in the stores on exit, however it is left.

    A box in this host's store is verified where it lies and held there, and `write` copies it straight
    into a CPU target: no scratch memory, whose first touch is what costs. A box from another host that
    several local ranks need is fetched into this host's store once and, for a CPU target, held there the
    same way; any other box from another host, a relayed one when that store has no room, and every box for
    an accelerator target land in scratch (one huge-page arena):
    contiguous in its tensor, in a scratch copy of the tensor, written in one copy; otherwise in a buffer
    of its own, copied into the target's view. Boxes read from one store are batched (one lookup on this
    host, one request over the network per batch) and the stores are read in parallel. Not `atomic`: a
    box from another host lands straight in its CPU target (a failed load leaves the target part written)."""

    def __init__(
        self, shards: dict[str, LocalShard], at: Version, concurrency: int, bd: Breakdown, atomic: bool = True
    ) -> None:
        self.shards, self.at, self.concurrency, self.bd = shards, at, concurrency, bd
        self.atomic = atomic  # False: a box in one run of a CPU target lands in it, not in scratch
        self._holds: list[tuple[Held, list[Read]]] = []  # each hold with the reads it serves
        self._staged: dict[str, Staged] = {}  # scratch copies of whole tensors
        self._apart: list[tuple[torch.Tensor, np.ndarray]] = []  # (the target's view, the box's own buffer)

    def __enter__(self) -> HeldBoxes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def read(self, reads: list[Read]) -> None:
        """Pull or verify every box; a store's failure is a StateError (the stores' fault), and a failed
        read lets go of what it held at once."""
        held = [r for r in reads if self._in_place(r)]
        here, far = [r for r in held if r.peer is None], [r for r in held if r.peer is not None]
        with self.bd.phase("scratch"):
            into = self._scratch([r for r in reads if not self._in_place(r)])
        kinds = [("shm_reads", here or into.copies, partial(self._hold_here, here, into.copies)),
                 ("relayed_reads", into.relayed or far, partial(self._hold_relayed, far, into.relayed)),
                 ("network_reads", into.network, partial(self._read, into.network))]  # fmt: skip
        todo = [(kind, fn) for kind, work, fn in kinds if work]
        try:
            with self.bd.phase("reads"):  # the kinds at once (one kind: in this thread)
                each(lambda kind_fn: _timed(self.bd, *kind_fn), todo)
        except StoreError as e:
            self.release()
            raise StateError(f"loading the snapshot of {self.at.job!r} at step {self.at.step}: {e}") from e
        except BaseException:
            self.release()
            raise

    def write(self) -> None:
        """Every box into its target: first the whole tensors, then the boxes over them. Called once every
        rank's boxes arrived and verified, so a failed load leaves every target as it was."""
        for st in self._staged.values():
            st.finish()
        for view, buf in self._apart:
            src = torch.from_numpy(buf)
            copy_into(view, src.view(view.dtype) if view.dtype in VIEW_AS else src)
        for h, reads in self._holds:  # dtypes checked by hold_boxes
            for r, arr in zip(reads, h.arrays):
                shard = self.shards[r.target]
                dst = as_numpy(shard.local[r.fetch.box.relative_to(shard.box).slices()])
                np.copyto(dst, arr.view(dst.dtype), casting="no")  # bfloat16: uint16 on both sides

    def release(self) -> None:
        """Let go of the boxes held in the stores (after the write or instead of it; once)."""
        holds, self._holds = self._holds, []
        for h, _ in holds:
            h.close()

    def _in_place(self, r: Read) -> bool:
        return r.store.is_local and self.shards[r.target].local.device.type == "cpu"

    def _scratch(self, pulled: list[Read]) -> _Requests:
        """Scratch for the boxes that do not stay in a store, from one arena, and the reads into it."""
        shards = self.shards
        rels = [r.fetch.box.relative_to(shards[r.target].box) for r in pulled]
        runs = [_contiguous(rel, shards[r.target].box.shape) for r, rel in zip(pulled, rels)]
        whole = sorted({r.target for r, run in zip(pulled, runs) if run})
        direct = set() if self.atomic else {n for n in whole if host_resident(shards[n].local)}
        dtypes = {n: shards[n].array_dtype for n in {r.target for r in pulled}}
        apart = [rel.volume * dtypes[r.target].itemsize for r, rel, run in zip(pulled, rels, runs) if not run]
        arena = Arena(Arena.size_of([shards[n].local.nbytes for n in whole if n not in direct] + apart))
        self._staged = {
            n: Staged(shards[n].local, fill=False, scratch=None if n in direct else arena) for n in whole
        }
        into = _Requests()
        for r, rel, run in zip(pulled, rels, runs):
            if run:
                out = self._staged[r.target].array[(*rel.slices(), ...)]
            else:
                dtype = dtypes[r.target]
                out = arena.take(rel.volume * dtype.itemsize).view(dtype).reshape(rel.shape)
                self._apart.append((shards[r.target].local[rel.slices()], out))
            into.add(r, out, self.at)
        return into

    def _read(self, requests: list[tuple[StoreClient, str, int, str, Box, np.ndarray]]) -> None:
        read_many(requests, self.concurrency, self.at.save_id)

    def _hold_here(
        self, here: list[Read], copies: list[tuple[StoreClient, str, int, str, Box, np.ndarray]]
    ) -> None:
        self._read(copies)
        by_store: dict[int, tuple[StoreClient, list[Read]]] = {}
        for r in here:
            by_store.setdefault(id(r.store), (r.store, []))[1].append(r)
        at = self.at
        for c, reads in by_store.values():
            asked = [(r.blob, r.src_box, self.shards[r.target].dtype) for r in reads]
            self._holds.append((c.hold_boxes(at.job, at.step, asked, at.save_id), reads))

    def _hold_relayed(
        self, far: list[Read], relayed: list[tuple[StoreClient, str, str, Box, np.ndarray]]
    ) -> None:
        """The relay: this host's store fetches each box once from its peer; the boxes for CPU targets are
        held there, or land in scratch when the store has no room for them."""
        at = self.at
        relay_many(relayed, at.job, at.step, self.concurrency, at.save_id)
        asked = [(r.store, r.peer, r.blob, r.src_box, self.shards[r.target].dtype) for r in far]
        try:
            made = hold_relayed_many(asked, at.job, at.step, self.concurrency, at.save_id)
        except MemoryLimitError:  # no room in this host's store: the boxes land in scratch instead
            self._read(_into_scratch(far, self.shards, self._apart, at))
            return
        for h, which in made:
            self._holds.append((h, [far[i] for i in which]))


def _into_scratch(
    relayed: list[Read],
    shards: dict[str, LocalShard],
    apart: list[tuple[torch.Tensor, np.ndarray]],
    at: Version,
) -> list[tuple[StoreClient, str, int, str, Box, np.ndarray]]:
    """Direct reads from the peers of boxes meant to be relayed, each into a scratch buffer of its own
    (added to `apart`, which the write copies into the targets)."""
    dtype = {n: shards[n].array_dtype for n in {r.target for r in relayed}}
    arena = Arena(Arena.size_of([r.fetch.box.volume * dtype[r.target].itemsize for r in relayed]))
    reads = []
    for r in relayed:
        f, dt, shard = r.fetch, dtype[r.target], shards[r.target]
        out = arena.take(f.box.volume * dt.itemsize).view(dt).reshape(f.box.shape)
        apart.append((shard.local[f.box.relative_to(shard.box).slices()], out))
        assert r.peer is not None
        reads.append((client(r.peer), at.job, at.step, r.blob, r.src_box, out))
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
