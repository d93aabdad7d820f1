"""The projected time of a reconfiguration: a bottleneck model over the planner's exact byte counts.

A change costs one save and one load. Each has a fixed part (per rank: a constant, plus a little per tensor
it saves or fetches, plus the cost of reaching other hosts' stores) and a part that grows with bytes. The
byte part is decided by the busiest resource, as the ranks work in parallel: on every host, the copy path
(its ranks through tenplex's save or load path, each at the rate one core measured, and no faster than the
device's PCIe link when the state lives on a GPU) and the host's link (its cross-host bytes, the larger of
in and out, over the NIC's bandwidth). The busiest host's time is the projection.

The fixed costs and the per-core rates are measured, not assumed: `scripts/reconfig_model.py` derives them
from results/bench_reconfig_fixed.json (the intercepts: the reference's tensors with 5 MB of bytes),
results/bench_reconfig.json (the slopes: 1.2 GB) and results/bench_reconfig_netns.json (what hosts apart
add), and writes them to `reconfig_costs.json` here. The same
model, run the way the development machine ran those benchmarks (every emulated host sharing its cores,
see `emulate`), is checked against every measured point by tests/test_estimate.py. The links are named
assumptions (`LINKS`), not measurements.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib import resources

from ..ptc import PTCError
from .plan import Plan, Route

GB = 1e9


@dataclass(frozen=True)
class Costs:
    """tenplex's own path, measured on one machine: fixed seconds per rank, and GB/s of one core."""

    cores: int  # the measuring machine's cores, which its emulated hosts shared
    save_fixed_s: float  # one rank's save, on a core of its own, beyond its bytes
    save_per_tensor_s: float  # and per tensor the rank saves
    load_fixed_s: float
    load_per_fetch_s: float  # per box a rank fetches
    load_remote_s: float  # once per load that reaches another host's store
    save_core_GBps: float  # bytes one core takes through a save (copy into the store, hashed)
    load_core_GBps: float  # bytes one core takes through a load's read (verified, copied into the tensors)
    net_core_GBps: float  # one core's extra work per cross-host byte (both ends, measured on one machine;
    # on a cluster each end's host does half)
    memcpy_GBps: float  # the machine's memcpy in the slope's run: how fast that machine was then
    # what namespace hosts add to a save and to a load per host beyond the first, and per GB crossing their
    # links on one core beyond the link's time or the cores' (every host's veth, bridge, shaping qdisc and
    # connections on the one machine's kernel and cores): emulation only, `emulate` counts them, `estimate`
    # does not (a cluster's hosts each have their own)
    ns_save_host_s: float
    ns_load_host_s: float
    # the interpreter's speed in the slope's run (rounds/s of benchmarks/floors.py's probe), by which the
    # fixed parts scale from one run to another (0: not measured, the memcpy ratio stands in)
    interp_per_s: float = 0.0
    ns_s_per_GB: float = 0.0
    sources: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: dict) -> Costs:
        return cls(**{**data, "sources": tuple(data.get("sources", ()))})

    def to_json(self) -> dict:
        return {**asdict(self), "sources": list(self.sources)}


def packaged_costs() -> Costs:
    """The costs `python scripts/reconfig_model.py` derived from the committed benchmark results."""
    text = resources.files(__package__).joinpath("reconfig_costs.json").read_text()
    return Costs.from_json(json.loads(text))


@dataclass(frozen=True)
class Links:
    """Where the bytes go on a cluster: an assumption, named in every projection."""

    name: str
    link_GBps: float  # per host and direction (a NIC), or per device when `staged` is false
    pcie_GBps: float = 25.0  # device <-> host memory per GPU (PCIe Gen4 x16, what it reaches in practice)
    staged: bool = True  # through host memory and tenplex's stores; False: device to device (not tenplex)

    def describe(self) -> str:
        if not self.staged:
            return (
                f"{self.name}: device to device at {self.link_GBps:g} GB/s per device and direction, no "
                "host-memory staging (a bound for a GPU-direct path, not tenplex's path today)"
            )
        return (
            f"{self.name}: {self.link_GBps:g} GB/s per host and direction across hosts; "
            f"state staged through host memory at up to {self.pcie_GBps:g} GB/s per device (PCIe)"
        )


LINKS: dict[str, Links] = {
    "100g": Links("100 Gbit/s NIC", 12.5),  # the interconnect class the original Tenplex ran on
    "400g": Links("400 Gbit/s NIC", 50.0),
    "nvlink": Links("NVLink 4", 450.0, staged=False),  # per direction: half of the H100 total
}


def parse_links(text: str) -> Links:
    """A name of `LINKS`, or a NIC speed in Gbit/s (e.g. `200`)."""
    if text in LINKS:
        return LINKS[text]
    try:
        gbit = float(text)
    except ValueError:
        gbit = 0.0
    if not gbit > 0 or gbit == float("inf"):
        raise PTCError(
            f"--bandwidth {text!r}: expected {', '.join(LINKS)} or a NIC speed in Gbit/s, e.g. 200"
        )
    return Links(f"{gbit:g} Gbit/s NIC", gbit / 8)


@dataclass
class Demand:
    """What one change asks of every host and rank, from the plan: the model's only input."""

    saved: Counter[str] = field(default_factory=Counter)  # bytes each host's ranks save (one copy each)
    read: Counter[str] = field(default_factory=Counter)  # bytes each host's ranks read (every route)
    ingress: Counter[str] = field(default_factory=Counter)
    egress: Counter[str] = field(default_factory=Counter)
    old_ranks: Counter[str] = field(default_factory=Counter)
    new_ranks: Counter[str] = field(default_factory=Counter)
    device_bytes: Counter[str] = field(default_factory=Counter)  # bytes each device sends or receives
    tensors_saved: int = 0  # the most tensors one rank saves
    fetches: int = 0  # the most boxes one rank fetches
    remote: bool = False  # some rank reads from another host's store

    @property
    def ranks(self) -> tuple[int, int]:
        return sum(self.old_ranks.values()), sum(self.new_ranks.values())

    @property
    def hosts(self) -> int:
        return len(set(self.old_ranks) | set(self.new_ranks))

    def total(self, what: str) -> int:
        """Summed over the hosts: `saved`, `read`, `ingress` or `egress`."""
        return sum(getattr(self, what).values())


def demand(plan: Plan) -> Demand:
    """Per host and rank, the bytes saved, read and crossing links: one pass over the plan's moves."""
    old, new = plan.old, plan.new
    d = Demand(old_ranks=Counter(old.mesh.hosts), new_ranks=Counter(new.mesh.hosts))
    saved_by: Counter[int] = Counter()
    for name, meta in old.tensors.items():
        for piece in old.pieces(name):  # one holder saves a replicated piece
            d.saved[old.mesh.hosts[piece.holders[0]]] += piece.box.volume * meta.itemsize
            saved_by[piece.holders[0]] += 1
    fetches: Counter[int] = Counter()
    for g in plan.groups:
        weight = sum(new.tensors[n].itemsize for n in g.tensors)
        for m in g.moves:
            nbytes, host = m.box.volume * weight, new.mesh.hosts[m.dst]
            d.read[host] += nbytes
            fetches[m.dst] += len(g.tensors)
            if m.route == Route.CROSS_HOST:
                d.ingress[host] += nbytes
                d.egress[old.mesh.hosts[m.src]] += nbytes
                d.remote = True
            if m.route != Route.KEPT:
                d.device_bytes[new.mesh.devices[m.dst]] += nbytes
                d.device_bytes[old.mesh.devices[m.src]] += nbytes
    d.tensors_saved = max(saved_by.values(), default=0)
    d.fetches = max(fetches.values(), default=0)
    return d


@dataclass
class Estimate:
    save_s: float
    load_s: float
    bottleneck: str  # what decided the byte part of the load
    assumptions: list[str]

    @property
    def total_s(self) -> float:
        return self.save_s + self.load_s

    def to_json(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


def fixed_s(d: Demand, c: Costs) -> tuple[float, float]:
    """One rank's fixed seconds per save and per load, on a core of its own."""
    save = c.save_fixed_s + c.save_per_tensor_s * d.tensors_saved
    load = c.load_fixed_s + c.load_per_fetch_s * d.fetches + c.load_remote_s * d.remote
    return save, load


def estimate(plan: Plan, links: Links, costs: Costs | None = None) -> Estimate:
    """The projected seconds of this change on a cluster: every rank on a core of its own, every host with
    its own copy path and link."""
    c = costs or packaged_costs()
    d = demand(plan)
    save_fixed, load_fixed = fixed_s(d, c)
    said = [
        links.describe(),
        f"tenplex's path per rank (one core): save {c.save_core_GBps:.1f} GB/s, load "
        f"{c.load_core_GBps:.1f} GB/s, plus {1 / c.net_core_GBps:.2f} s/GB of cross-host bytes; fixed per "
        f"rank {c.save_fixed_s * 1e3:.0f} ms a save + {c.save_per_tensor_s * 1e6:.0f} us a tensor, "
        f"{c.load_fixed_s * 1e3:.0f} ms a load + {c.load_per_fetch_s * 1e6:.0f} us a box, +"
        f"{c.load_remote_s * 1e3:.0f} ms reaching other hosts (measured: {', '.join(c.sources)})",
        "what namespace hosts added beyond loopback hosts (per host, per GB) is left out: one machine's "
        "kernel and cores did every emulated host's networking there; a network's latency is not modelled",
        "every rank on a core of its own; a host's store sends with its ranks' cores, each end of a "
        "cross-host byte doing half the work measured for both",
        "fixed costs per rank as measured with 4 to 8 ranks: their growth with more ranks is not modelled",
        f"this change's fixed costs: {save_fixed * 1e3:.0f} ms its save, {load_fixed * 1e3:.0f} ms its load",
    ]
    if not links.staged:  # device to device: the busiest device's link decides
        busiest = max(d.device_bytes.values(), default=0)
        return Estimate(save_fixed, load_fixed + busiest / (links.link_GBps * GB), "device links", said)
    per_rank_save = min(c.save_core_GBps, links.pcie_GBps) * GB
    per_rank_load = min(c.load_core_GBps, links.pcie_GBps) * GB
    save = max((b / (d.old_ranks[h] * per_rank_save) for h, b in d.saved.items()), default=0.0)
    worst, where = 0.0, "nothing moves"
    for h in sorted(set(d.read) | set(d.egress)):  # sorted: ties name the same host every run
        cores = max(d.new_ranks[h], d.old_ranks[h])  # the sending end's share runs on the host's store
        copy = d.read[h] / (d.new_ranks[h] * per_rank_load) if d.read[h] else 0.0
        copy += (d.ingress[h] + d.egress[h]) / (2 * cores * c.net_core_GBps * GB)  # each end half
        link = max(d.ingress[h], d.egress[h]) / (links.link_GBps * GB)
        if max(copy, link) > worst:
            worst, where = max(copy, link), f"{h}'s {'link' if link >= copy else 'copy path'}"
    return Estimate(save_fixed + save, load_fixed + worst, where, said)


def slowdowns(
    ref_memcpy: float, ref_interp: float, memcpy: float | None, interp: float | None
) -> tuple[float, float]:
    """How much slower than the reference run a run's byte parts and fixed parts ran: by its memcpy, and by
    its interpreter (the memcpy ratio stands in where either run did not measure its interpreter)."""
    byte = ref_memcpy / memcpy if memcpy else 1.0
    return byte, ref_interp / interp if interp and ref_interp else byte


def emulate(
    d: Demand,
    c: Costs,
    link_GBps: float | None = None,
    memcpy_GBps: float | None = None,
    netns: bool = False,
    interp_per_s: float | None = None,
) -> Estimate:
    """The same model as the development machine runs a change: every emulated host and rank shares its
    `cores` (so fixed costs queue when ranks outnumber cores, and all bytes pass one machine's copy path),
    each namespace host has its own shaped link (`link_GBps`; loopback hosts have none) and its bytes cost
    the machine's kernel more than loopback's, and the machine ran at `memcpy_GBps` and its interpreter at
    `interp_per_s` in that run: the byte parts scale by the first, the fixed parts by the second (this VM
    slowed them by different factors from one day to the next)."""
    slow, slow_fixed = slowdowns(c.memcpy_GBps, c.interp_per_s, memcpy_GBps, interp_per_s)
    save_fixed, load_fixed = fixed_s(d, c)
    old, new = d.ranks
    others = (d.hosts - 1) * netns  # namespace hosts beyond the first
    save = (max(1.0, old / c.cores) * save_fixed + others * c.ns_save_host_s) * slow_fixed
    save += sum(d.saved.values()) / (c.cores * c.save_core_GBps * GB) * slow
    cpu = sum(d.read.values()) / (c.cores * c.load_core_GBps * GB)
    cpu += sum(d.ingress.values()) / (c.cores * c.net_core_GBps * GB)
    busiest = max((max(d.ingress[h], d.egress[h]) for h in set(d.ingress) | set(d.egress)), default=0)
    link = busiest / (link_GBps * GB) if link_GBps else 0.0
    load = (max(1.0, new / c.cores) * load_fixed + others * c.ns_load_host_s) * slow_fixed
    load += max(cpu * slow, link)
    load += sum(d.ingress.values()) / GB * c.ns_s_per_GB / c.cores * slow * netns  # after either
    where = "links" if link > cpu * slow else "the machine's cores"
    return Estimate(save, load, where, [f"emulated on {c.cores} cores"])
