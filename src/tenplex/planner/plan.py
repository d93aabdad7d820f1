"""The decentralized plan: for every shard of every new rank, which source rank sends which box.

Tensors whose shape and placements agree get the same fetches, so the planner works on such groups: the
cost grows with the number of distinct layouts and holders, not with tensors x ranks. Overlaps are found
per dimension by bisection over the source grid, never by an all-pairs search.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from itertools import product

from ..ptc import PTC, AnyPlacement, Box, Piece, PTCError
from .stats import Bandwidth, PlanStats, StatsBuilder


class PlanError(PTCError):
    """The two PTCs cannot be related (different tensors, shapes or dtypes, unknown lost devices)."""


class Route(StrEnum):
    KEPT = "kept"
    SAME_HOST = "same_host"
    CROSS_HOST = "cross_host"
    RELAYED = "relayed"  # a box this host's store already pulled across for another local rank


@dataclass(frozen=True, slots=True)
class Fetch:
    """Copy `box` (global coordinates) of `tensor` from old rank `src` into new rank `dst`."""

    tensor: str
    box: Box
    dst: int
    src: int
    route: Route

    def __reduce__(self) -> tuple:  # as `Box`: rank 0 of a load sends each rank its fetches
        return Fetch, (self.tensor, self.box, self.dst, self.src, self.route)


@dataclass(frozen=True, slots=True)
class Move:
    box: Box
    dst: int
    src: int
    route: Route


@dataclass(frozen=True)
class Group:
    """Tensors that share shape and both placements, and the moves that serve all of them."""

    tensors: tuple[str, ...]
    moves: tuple[Move, ...]


@dataclass(frozen=True)
class Plan:
    old: PTC
    new: PTC
    groups: tuple[Group, ...]
    unrecoverable: tuple[tuple[str, Box], ...]
    stats: PlanStats
    central: bool = False

    @property
    def complete(self) -> bool:
        return not self.unrecoverable

    def fetches(self) -> Iterator[Fetch]:
        for g in self.groups:
            for t in g.tensors:
                for m in g.moves:
                    yield Fetch(t, m.box, m.dst, m.src, m.route)

    def for_rank(self, rank: int) -> list[Fetch]:
        """The part of the plan new rank `rank` executes."""
        out = []
        for g in self.groups:
            mine = [m for m in g.moves if m.dst == rank]
            out.extend(Fetch(t, m.box, m.dst, m.src, m.route) for t in g.tensors for m in mine)
        return out

    def unrecoverable_report(self) -> list[dict]:
        return [{"tensor": t, "box": b.to_json()} for t, b in self.unrecoverable]


def check_compatible(old: PTC, new: PTC) -> None:
    only_old = sorted(set(old.tensors) - set(new.tensors))
    only_new = sorted(set(new.tensors) - set(old.tensors))
    if only_old or only_new:
        raise PlanError(
            "the two layouts hold different tensors: "
            f"only in the old: {only_old[:5]}{'...' if len(only_old) > 5 else ''}; "
            f"only in the new: {only_new[:5]}{'...' if len(only_new) > 5 else ''}"
        )
    for name, meta in new.tensors.items():
        was = old.tensors[name]
        if (was.shape, was.dtype) != (meta.shape, meta.dtype):
            raise PlanError(
                f"tensor {name!r} is {was.dtype}{list(was.shape)} in the old layout "
                f"but {meta.dtype}{list(meta.shape)} in the new"
            )


def lost_ranks(old: PTC, lost: Iterable[str]) -> frozenset[int]:
    """Old ranks whose device id or host is named in `lost`."""
    names = set(lost)
    unknown = names - set(old.mesh.devices) - set(old.mesh.hosts)
    if unknown:
        raise PlanError(f"lost devices or hosts {sorted(unknown)} are not in the old layout")
    return frozenset(
        r for r, (d, h) in enumerate(zip(old.mesh.devices, old.mesh.hosts)) if d in names or h in names
    )


GroupKey = tuple[tuple[int, ...], AnyPlacement, AnyPlacement]


def group_tensors(old: PTC, new: PTC) -> dict[GroupKey, list[str]]:
    groups: dict[GroupKey, list[str]] = defaultdict(list)
    for name, meta in new.tensors.items():
        groups[(meta.shape, old.placements[name], new.placements[name])].append(name)
    return groups


class SourceGrid:
    """The distinct source boxes of one layout, indexed per dimension for overlap queries."""

    def __init__(self, pieces: tuple[Piece, ...], ndim: int) -> None:
        self.by_key = {tuple(zip(p.box.start, p.box.stop)): p for p in pieces}
        self.intervals = [sorted({(p.box.start[d], p.box.stop[d]) for p in pieces}) for d in range(ndim)]
        self.starts = [[a for a, _ in iv] for iv in self.intervals]
        self.stops = [[b for _, b in iv] for iv in self.intervals]

    def overlapping(self, box: Box) -> Iterator[Piece]:
        per_dim = []
        for d in range(box.ndim):
            lo = bisect_right(self.stops[d], box.start[d])
            hi = bisect_left(self.starts[d], box.stop[d])
            per_dim.append([iv for iv in self.intervals[d][lo:hi] if iv[1] > iv[0]])
        for key in product(*per_dim):
            piece = self.by_key.get(key)
            if piece is not None:
                yield piece


class SourcePolicy:
    """Which surviving replica sends each part to each new holder: the holder's own device, else the least
    loaded replica on its host, else one sender per (host, part), whose host's store relays the part to
    the host's other ranks; remote senders are taken least-loaded host first, one per host, so that the
    crossing bytes spread over the old hosts. Loads carry over from group to group: deterministic, since
    groups and pieces come in a fixed order."""

    def __init__(self, old: PTC, new: PTC, stats: StatsBuilder) -> None:
        self.old_hosts, self.old_devices = old.mesh.hosts, old.mesh.devices
        self.new_hosts, self.new_devices = new.mesh.hosts, new.mesh.devices
        self.stats = stats
        self.device_load: dict[int, int] = defaultdict(int)  # bytes each old rank sends
        self.host_load: dict[str, int] = defaultdict(int)  # bytes each old host sends across hosts
        self.remote: dict[tuple[str, Box], int] = {}  # (new host, part) -> its sender, in this group

    def start_group(self) -> None:
        """A new group of tensors: its parts weigh differently, so no sender carries over."""
        self.remote = {}

    def serve(
        self, holders: tuple[int, ...], part: Box, alive: list[int], nbytes: int, out: list[Move]
    ) -> None:
        """The moves that bring `part` (`nbytes` over the group) from one of `alive` to each of `holders`."""
        by_device = {self.old_devices[r]: r for r in alive}
        by_host: dict[str, list[int]] = defaultdict(list)
        for r in alive:
            by_host[self.old_hosts[r]].append(r)
        needy = {self.new_hosts[d] for d in holders} - by_host.keys()
        self.stats.lower_bound += nbytes * len(needy)
        senders: list[int] = []  # remote candidates, one per host, least loaded first (made when needed)
        for dst in holders:
            host = self.new_hosts[dst]
            src = by_device.get(self.new_devices[dst])
            if src is not None:
                route = Route.KEPT
            elif host in by_host:
                src = min(by_host[host], key=self._device_key)
                self.device_load[src] += nbytes
                route = Route.SAME_HOST
            elif (host, part) in self.remote:
                src, route = self.remote[(host, part)], Route.RELAYED
            else:
                src = self.remote[(host, part)] = self._sender(by_host, senders, nbytes)
                route = Route.CROSS_HOST
            out.append(Move(part, dst, src, route))
            self.stats.add(route.value, nbytes, self.old_hosts[src], host)

    def _device_key(self, r: int) -> tuple[int, int]:
        return self.device_load[r], r

    def _sender(self, by_host: dict[str, list[int]], senders: list[int], nbytes: int) -> int:
        if not senders:
            senders.extend(
                sorted(
                    (min(rs, key=self._device_key) for rs in by_host.values()),
                    key=lambda r: (self.host_load[self.old_hosts[r]], self.device_load[r], r),
                )
            )
        src = senders.pop(0)
        self.host_load[self.old_hosts[src]] += nbytes
        self.device_load[src] += nbytes
        return src


def plan(
    old: PTC,
    new: PTC,
    lost: Iterable[str] = (),
    bandwidth: Bandwidth | None = None,
) -> Plan:
    """Every new shard covered exactly once, from the nearest surviving replica, balancing the senders
    (`SourcePolicy`).

    Deterministic: the same inputs give the same plan on every rank, so each rank can compute it alone.
    """
    started = time.perf_counter()
    check_compatible(old, new)
    dead = lost_ranks(old, lost)
    stats = StatsBuilder(old, new, bandwidth or Bandwidth())
    policy = SourcePolicy(old, new, stats)
    groups: list[Group] = []
    unrecoverable: list[tuple[str, Box]] = []
    for (shape, old_pl, new_pl), names in group_tensors(old, new).items():
        weight = sum(new.tensors[n].itemsize for n in names)  # bytes per element, summed over the group
        grid = SourceGrid(old._pieces(shape, old_pl), len(shape))
        moves: list[Move] = []
        policy.start_group()
        for target in new._pieces(shape, new_pl):
            for source in grid.overlapping(target.box):
                part = source.box.intersect(target.box)
                assert part is not None
                alive = [r for r in source.holders if r not in dead]
                if alive:
                    policy.serve(target.holders, part, alive, part.volume * weight, moves)
                else:
                    unrecoverable.extend((n, source.box) for n in names)
        groups.append(Group(tuple(names), tuple(moves)))
    result = stats.finish(len(dead))
    result.plan_seconds = time.perf_counter() - started
    return Plan(old, new, tuple(groups), tuple(unrecoverable), result)
