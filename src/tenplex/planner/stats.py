"""What a plan costs: bytes by class, the cross-host lower bound, per-host load and an estimated time."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..ptc import PTC


@dataclass(frozen=True)
class Bandwidth:
    """Bytes per second between hosts (per host, each direction) and for a copy within a host."""

    network: float = 12.5e9  # 100 Gbit/s, the interconnect class the original Tenplex ran on
    local: float = 9e9  # memcpy on the development machine


@dataclass
class PlanStats:
    kept: int = 0
    same_host: int = 0
    relayed: int = 0
    cross_host: int = 0
    cross_host_lower_bound: int = 0
    total_state: int = 0
    delivered: int = 0
    lost_ranks: int = 0
    host_ingress: dict[str, int] = field(default_factory=dict)
    host_egress: dict[str, int] = field(default_factory=dict)
    host_local: dict[str, int] = field(default_factory=dict)
    estimated_seconds: float = 0.0
    plan_seconds: float = 0.0

    @property
    def moved(self) -> int:
        return self.same_host + self.relayed + self.cross_host

    def to_json(self) -> dict:
        return {
            "bytes": {
                "kept": self.kept,
                "same_host": self.same_host,
                "relayed": self.relayed,
                "cross_host": self.cross_host,
                "cross_host_lower_bound": self.cross_host_lower_bound,
                "total_state": self.total_state,
                "delivered": self.delivered,
            },
            "hosts": {
                h: {
                    "ingress": self.host_ingress.get(h, 0),
                    "egress": self.host_egress.get(h, 0),
                    "local": self.host_local.get(h, 0),
                }
                for h in sorted(set(self.host_ingress) | set(self.host_egress) | set(self.host_local))
            },
            "lost_ranks": self.lost_ranks,
            "estimated_seconds": self.estimated_seconds,
            "plan_seconds": self.plan_seconds,
        }


class StatsBuilder:
    def __init__(self, old: PTC, new: PTC, bandwidth: Bandwidth) -> None:
        self.old, self.new, self.bandwidth = old, new, bandwidth
        self.by_route: dict[str, int] = defaultdict(int)
        self.ingress: dict[str, int] = defaultdict(int)
        self.egress: dict[str, int] = defaultdict(int)
        self.local: dict[str, int] = defaultdict(int)
        self.lower_bound = 0

    def add(self, route: str, nbytes: int, src_host: str, dst_host: str) -> None:
        self.by_route[route] += nbytes
        if route == "cross_host":
            self.egress[src_host] += nbytes
            self.ingress[dst_host] += nbytes
        elif route != "kept":
            self.local[dst_host] += nbytes

    def finish(self, lost_ranks: int) -> PlanStats:
        bw = self.bandwidth
        hosts = set(self.ingress) | set(self.egress) | set(self.local)
        makespan = max(
            (max(self.ingress[h], self.egress[h]) / bw.network + self.local[h] / bw.local for h in hosts),
            default=0.0,
        )
        r = self.by_route
        return PlanStats(
            kept=r["kept"],
            same_host=r["same_host"],
            relayed=r["relayed"],
            cross_host=r["cross_host"],
            cross_host_lower_bound=self.lower_bound,
            total_state=self.old.total_bytes,
            delivered=sum(r.values()),
            lost_ranks=lost_ranks,
            host_ingress=dict(self.ingress),
            host_egress=dict(self.egress),
            host_local=dict(self.local),
            estimated_seconds=makespan,
        )
