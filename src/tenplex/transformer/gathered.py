"""The PTC gathered from the ranks: what every rank holds, described by each and all-gathered.

Each rank describes its own shards; after one all-gather every rank builds the same PTC, with explicit
pieces so that any DTensor mesh, placement or pipeline split is described exactly. A rank's host is the
store it talks to, its device id is stable across restarts (TENPLEX_DEVICE, else host and local index).
"""

from __future__ import annotations

import hashlib
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..ptc import PTC, Box, Explicit, Mesh, Piece, PTCError, TensorMeta
from ..util import env
from . import world
from .breakdown import Breakdown
from .errors import StateError
from .shards import LocalShard

Span = tuple[tuple[int, ...], tuple[int, ...]]  # a box as (start, stop): what the ranks send each other


@dataclass
class RankShards:
    rank: int
    store: str
    device: str
    # name -> (global shape, dtype, (start, stop) of this rank's box)
    tensors: dict[str, tuple[tuple[int, ...], str, Span]] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


def describe(
    store: str, shards: dict[str, LocalShard], values: dict[str, Any], group: world.Group = None
) -> RankShards:
    me = world.rank(group)
    device = env.get(env.DEVICE) or f"{store}#{env.local_rank(me)}"
    return RankShards(me, store, device, {n: s.describe() for n, s in shards.items()}, values)


@dataclass
class Writers:
    """The writers' layout of a save (`writers(build_ptc(...))`, values apart), its manifest JSON, what
    this rank writes and what each store must hold: kept per layout, so that periodic saves of an
    unchanged layout neither gather the shard descriptions nor build and check the PTC again."""

    ptc: PTC
    layout: dict[str, Any]  # ptc.to_json() without "values"
    blobs: dict[str, list[str]]  # store -> the blobs it must hold
    _mine: dict[int, set[str]] = field(default_factory=dict)

    def mine(self, me: int) -> set[str]:
        """The tensors rank `me` writes: per rank, since one process may hold another rank of the same
        layout in a later save (a standby process, identical shards) and must not write the first's."""
        if me not in self._mine:
            self._mine[me] = {s.tensor for s in self.ptc.shards(me)}
        return self._mine[me]


class LayoutCache:
    """The writers of the layouts this process saved lately, by a digest of every rank's shard
    descriptions; process-wide, since periodic saves of one layout come through many calls of `save`."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._by_key: OrderedDict[str, Writers] = OrderedDict()  # the newest last

    def keys(self) -> list[str]:
        return list(self._by_key)

    def get(self, key: str) -> Writers:
        self._by_key.move_to_end(key)
        return self._by_key[key]

    def put(self, key: str, ptc: PTC) -> Writers:
        """The writers of `ptc` (the writers' layout), kept under `key`; the oldest beyond `keep` go."""
        layout = ptc.to_json()
        layout.pop("values", None)
        hosts = ptc.mesh.hosts
        blobs: dict[str, list[str]] = {h: [] for h in hosts}
        for r, host in enumerate(hosts):
            blobs[host].extend(blob_name(r, s.tensor) for s in ptc.shards(r))
        found = self._by_key[key] = Writers(ptc, layout, blobs)
        while len(self._by_key) > self.keep:
            self._by_key.popitem(last=False)
        return found

    def pop(self, key: str) -> None:
        self._by_key.pop(key, None)

    def clear(self) -> None:
        self._by_key.clear()


LAYOUTS = LayoutCache()


def gather_writers(
    store: str, shards: dict[str, LocalShard], values: dict[str, Any], group: world.Group, bd: Breakdown
) -> tuple[Writers, dict[str, Any], str]:
    """The writers' layout, the job's values (on rank 0, which writes the manifest; empty elsewhere) and
    the save's id (rank 0's), which every rank's create and put name so that no blob of another attempt at
    the step ends up in this save. One gather to rank 0 of each rank's values, a digest of its shard
    descriptions and the layouts it knows, and one broadcast of rank 0's answer; only when some rank lacks
    this layout, an all-gather of the descriptions (every rank decides from the same answer)."""
    mine = describe(store, shards, {}, group)
    digest = _digest((mine.store, mine.device, mine.tensors))
    merged: dict[str, Any] = {}

    def decide(answers: list[tuple[str, dict[str, Any], list[str]]]) -> tuple[str, bool, str]:
        for _, vals, _ in answers:  # on rank 0 only: the values stay here
            for k, v in vals.items():
                merged.setdefault(k, v)
        key = _digest([a[0] for a in answers])
        return key, all(key in known for _, _, known in answers), uuid.uuid4().hex

    with bd.phase("gather"):
        key, known, save_id = world.gather_then((digest, values, LAYOUTS.keys()), decide, group)
    if known:
        return LAYOUTS.get(key), merged, save_id
    with bd.phase("gather"):
        layouts = world.all_gather(mine, group)
    with bd.phase("plan"):
        return LAYOUTS.put(key, writers(build_ptc(layouts))), merged, save_id


def _digest(obj: Any) -> str:
    return hashlib.blake2b(repr(obj).encode(), digest_size=16).hexdigest()


def merged_values(layouts: list[RankShards]) -> dict[str, Any]:
    """The job's values: each name as its lowest rank has it (a pipeline stage's entries come from it)."""
    out: dict[str, Any] = {}
    for lay in layouts:
        for k, v in lay.values.items():
            out.setdefault(k, v)
    return out


def check_devices(devices: list[str]) -> None:
    """Every rank's device id is its own (the plan keeps in place what a device held before)."""
    if len(set(devices)) != len(devices):
        raise StateError(f"two ranks claim the same device id: {devices} (set TENPLEX_DEVICE)")


def build_ptc(layouts: list[RankShards], values: dict | None = None) -> PTC:
    """One PTC over a 1-D mesh of ranks; every tensor's pieces are the distinct boxes and their holders."""
    devices = [lay.device for lay in layouts]
    check_devices(devices)
    mesh = Mesh((("rank", len(layouts)),), tuple(devices), tuple(lay.store for lay in layouts))
    kinds: dict[str, tuple[tuple[int, ...], str]] = {}
    holders: dict[str, dict[Span, list[int]]] = {}  # tensor -> box -> its holders, in rank order
    for lay in layouts:
        r = lay.rank
        for name, (shape, dtype, span) in lay.tensors.items():
            boxes = holders.get(name)
            if boxes is None:
                kinds[name], holders[name] = (shape, dtype), {span: [r]}
                continue
            seen = kinds[name]
            if seen[0] != shape or seen[1] != dtype:
                raise StateError(
                    f"tensor {name!r} is {seen[1]}{list(seen[0])} on one rank "
                    f"but {dtype}{list(shape)} on rank {lay.rank}"
                )
            ranks = boxes.get(span)
            if ranks is None:
                boxes[span] = [r]
            else:
                ranks.append(r)
    entries = []
    for name, (shape, dtype) in kinds.items():  # each distinct box is made (and checked) once
        pieces = (Piece(Box(*span), tuple(sorted(r))) for span, r in holders[name].items())
        kept = tuple(p for p in pieces if not p.box.empty)
        entries.append((TensorMeta(name, shape, dtype), Explicit(kept)))
    try:
        return PTC.build(mesh, entries, values)
    except PTCError as e:
        raise StateError(f"the ranks' shards do not describe whole tensors: {e}") from None


def writers(ptc: PTC) -> PTC:
    """The same layout with, per piece, one holder per host: the copy that is written to that host's store."""
    hosts = ptc.mesh.hosts
    entries = []
    for name, meta in ptc.tensors.items():
        pieces = []
        for p in ptc.pieces(name):
            first: dict[str, int] = {}
            for r in p.holders:
                first.setdefault(hosts[r], r)
            pieces.append(Piece(p.box, tuple(sorted(first.values()))))
        entries.append((meta, Explicit(tuple(pieces))))
    return PTC.build(ptc.mesh, entries, ptc.values)


def subset(ptc: PTC, names: set[str]) -> PTC:
    """The PTC of the tensors in `names` (itself when it has no others: building one checks every piece)."""
    if names >= ptc.tensors.keys():
        return ptc
    return PTC.build(
        ptc.mesh, [(ptc.tensors[n], ptc.placements[n]) for n in ptc.tensors if n in names], ptc.values
    )


def blob_name(rank: int, tensor: str) -> str:
    return f"r{rank}/{tensor}"
