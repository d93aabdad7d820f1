"""Rank placement: which device of the allocation each rank of the next layout runs on.

A pure function of the previous phase (its layout and devices), the next layout, the allocation and the
devices or hosts lost since: each rank goes to the device (or host) that holds most of its state, so the
load moves the fewest bytes. The state's shape comes from the workload (`ptc_of`): the reference workload
supplies its model's symbolic PTC; a script's layout is known only inside it, so its ranks keep the
allocation's order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..planner import assign
from ..ptc import PTC, PTCError
from ..ptc.layout import Layout
from .hosts import host_of

# the workload's state laid out as `layout` on (device id, host) pairs, in rank order
PTCOf = Callable[[Layout, Sequence[tuple[str, str]]], PTC]


@dataclass(frozen=True)
class Placed:
    """Where a phase ran: its layout and its devices in rank order."""

    layout: Layout
    devices: tuple[str, ...]


class MatchSkipped(PTCError):
    """The layouts cannot be matched (the allocation order is used instead); the message says why."""


def match(
    previous: Placed | None,
    layout: Layout,
    devices: Sequence[str],
    lost: Iterable[str],
    ptc_of: PTCOf | None,
) -> list[str]:
    """The allocation `devices` in rank order for `layout`. `lost`: device ids and host names gone since
    `previous` (their state is read from elsewhere). Raises `MatchSkipped` when the PTCs cannot be built or
    matched; with nothing to load (`previous` is None) or no PTC (`ptc_of` is None): allocation order."""
    if previous is None or ptc_of is None:
        return list(devices)
    before = list(previous.devices)
    gone = [x for x in lost if x in before or any(host_of(d) == x for d in before)]

    def on_hosts(devs: Sequence[str]) -> list[tuple[str, str]]:
        return [(d, host_of(d)) for d in devs]

    try:
        old, new = ptc_of(previous.layout, on_hosts(before)), ptc_of(layout, on_hosts(devices))
        return list(assign(old, new, sorted(gone)).mesh.devices)
    except PTCError as e:
        raise MatchSkipped(str(e)) from None
