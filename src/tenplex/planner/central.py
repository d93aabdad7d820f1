"""The central baseline (the paper's Tenplex-Central): gather all state on one host, then scatter it.

It moves the same boxes as the decentralized plan, but every byte goes through the central host, which is
what makes its makespan grow with the job's size.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..ptc import PTC, Box
from .plan import Group, Move, Plan, Route, SourceGrid, check_compatible, group_tensors, lost_ranks
from .stats import Bandwidth, StatsBuilder


def central_plan(
    old: PTC,
    new: PTC,
    lost: Iterable[str] = (),
    bandwidth: Bandwidth | None = None,
    center: str | None = None,
) -> Plan:
    """Gather one surviving copy of every source box on `center` (default: the host of old rank 0), then
    let every new host pull what its ranks need from there, once per host."""
    started = time.perf_counter()
    check_compatible(old, new)
    dead = lost_ranks(old, lost)
    center = center or old.mesh.hosts[0]
    stats = StatsBuilder(old, new, bandwidth or Bandwidth())
    old_hosts, new_hosts = old.mesh.hosts, new.mesh.hosts
    groups: list[Group] = []
    unrecoverable: list[tuple[str, Box]] = []
    for (shape, old_pl, new_pl), names in group_tensors(old, new).items():
        weight = sum(new.tensors[n].itemsize for n in names)
        pieces = old._pieces(shape, old_pl)
        gathered: dict[Box, int] = {}
        for piece in pieces:
            alive = [r for r in piece.holders if r not in dead]
            if not alive:
                unrecoverable.extend((n, piece.box) for n in names)
                continue
            src = min(alive, key=lambda r: (old_hosts[r] != center, r))
            gathered[piece.box] = src
            route = "same_host" if old_hosts[src] == center else "cross_host"
            stats.add(route, piece.box.volume * weight, old_hosts[src], center)
        grid = SourceGrid(tuple(p for p in pieces if p.box in gathered), len(shape))
        moves: list[Move] = []
        for target in new._pieces(shape, new_pl):
            for source in grid.overlapping(target.box):
                part = source.box.intersect(target.box)
                assert part is not None
                nbytes = part.volume * weight
                src = gathered[source.box]
                for host in {new_hosts[d] for d in target.holders}:
                    stats.add("same_host" if host == center else "cross_host", nbytes, center, host)
                for dst in target.holders:
                    moves.append(Move(part, dst, src, Route.CROSS_HOST))
        groups.append(Group(tuple(names), tuple(moves)))
    result = stats.finish(len(dead))
    result.plan_seconds = time.perf_counter() - started
    return Plan(old, new, tuple(groups), tuple(unrecoverable), result, central=True)
