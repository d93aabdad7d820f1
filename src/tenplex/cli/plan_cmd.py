"""`tenplex plan`: explain a reconfiguration of a model's state before a byte moves."""

from __future__ import annotations

import argparse
import json
import time

from ..planner import Bandwidth, Plan, assign_plan, central_plan, plan
from ..ptc import GPTConfig, Mesh, PTCError, device_id, gpt_ptc, preset
from ..util import human_bytes, print_table

LAYOUT_KEYS = ("dp", "tp", "pp")


def parse_layout(text: str) -> dict[str, int]:
    """`dp=2,tp=4,pp=2` -> {"dp": 2, "tp": 4, "pp": 2}; unspecified axes are 1."""
    out = dict.fromkeys(LAYOUT_KEYS, 1)
    seen = set()
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in LAYOUT_KEYS or key in seen:
            raise PTCError(f"malformed layout {text!r}: expected e.g. dp=2,tp=4,pp=2")
        try:
            out[key] = int(value)
        except ValueError:
            raise PTCError(f"malformed layout {text!r}: {key} must be an integer") from None
        if out[key] < 1:
            raise PTCError(f"malformed layout {text!r}: {key} must be at least 1")
        seen.add(key)
    if not seen:
        raise PTCError(f"malformed layout {text!r}: expected e.g. dp=2,tp=4,pp=2")
    return out


def allocate_devices(
    old: Mesh, count: int, devices_per_host: int, lost_hosts: set[str], redeploy: bool
) -> list[tuple[str, str]]:
    """Devices for the new layout: the surviving old devices first (unless redeploying), then fresh hosts."""
    pool = [] if redeploy else [(d, h) for d, h in zip(old.devices, old.hosts) if h not in lost_hosts]
    taken_hosts = {int(h[1:]) for h in old.hosts if h[1:].isdigit()}
    next_host = max(taken_hosts, default=-1) + 1
    while len(pool) < count:
        pool.extend((device_id(next_host, i), f"h{next_host}") for i in range(devices_per_host))
        next_host += 1
    return pool[:count]


def build_plans(args: argparse.Namespace) -> tuple[Plan, Plan, Plan]:
    """The plan, the central baseline and the plan with devices taken in numbering order."""
    cfg: GPTConfig = preset(args.model)
    src, dst = parse_layout(args.source), parse_layout(args.target)
    dph = args.devices_per_host
    if dph < 1:
        raise PTCError("--devices-per-host must be at least 1")
    old = gpt_ptc(cfg, src["dp"], src["tp"], src["pp"], devices_per_host=dph, zero=args.zero)
    hosts = old.mesh.host_names()
    lost_hosts = set()
    for h in args.lost_hosts:
        if not 0 <= h < len(hosts):
            raise PTCError(f"--lost-hosts {h}: the old layout has hosts 0..{len(hosts) - 1}")
        lost_hosts.add(hosts[h])
    n = dst["dp"] * dst["tp"] * dst["pp"]
    if args.devices is not None and args.devices != n:
        raise PTCError(f"--to {args.target} needs {n} devices, but --devices is {args.devices}")
    devices = allocate_devices(old.mesh, n, dph, lost_hosts, args.redeploy)
    numbered = gpt_ptc(cfg, dst["dp"], dst["tp"], dst["pp"], devices=devices, zero=args.zero)
    bw = Bandwidth(network=args.network_gbps * 1e9, local=args.local_gbps * 1e9)
    if args.assign == "match":
        p, by_numbering = assign_plan(old, numbered, lost_hosts, bw)
    else:
        p = by_numbering = plan(old, numbered, lost_hosts, bw)
    return p, central_plan(old, p.new, lost_hosts, bw), by_numbering


def report(p: Plan, c: Plan, by_numbering: Plan, args: argparse.Namespace, seconds: float) -> dict:
    s = p.stats.to_json()
    out = {
        "model": args.model,
        "from": parse_layout(args.source),
        "to": parse_layout(args.target),
        "devices": {"old": p.old.mesh.size, "new": p.new.mesh.size},
        "tensors": len(p.new.tensors),
        **s,
        "plan_seconds": seconds,
        "unrecoverable": p.unrecoverable_report(),
        "central": c.stats.to_json(),
        "assignment": {
            "mode": args.assign,
            "devices": list(p.new.mesh.devices),
            "cross_host_by_numbering": by_numbering.stats.cross_host,
        },
    }
    out["central"]["ratio_cross_host"] = (
        c.stats.cross_host / p.stats.cross_host if p.stats.cross_host else None
    )
    out["central"]["ratio_estimated_seconds"] = (
        c.stats.estimated_seconds / p.stats.estimated_seconds if p.stats.estimated_seconds else None
    )
    return out


def print_report(p: Plan, c: Plan, data: dict) -> None:
    s, cs = p.stats, c.stats
    print(
        f"{data['model']}: {data['from']} on {data['devices']['old']} devices -> {data['to']} on "
        f"{data['devices']['new']} devices; {data['tensors']} tensors, "
        f"state {human_bytes(s.total_state)}; planned in {data['plan_seconds']:.3f} s"
    )
    rows = [
        ("kept in place", s.kept, cs.kept),
        ("moved within a host", s.same_host, cs.same_host),
        ("relayed by a host's store", s.relayed, cs.relayed),
        ("moved across hosts", s.cross_host, cs.cross_host),
        ("cross-host lower bound", s.cross_host_lower_bound, s.cross_host_lower_bound),
    ]
    print_table(
        "bytes by class",
        ["", "tenplex", "central"],
        [[name, human_bytes(a), human_bytes(b)] for name, a, b in rows]
        + [["estimated time", f"{s.estimated_seconds:.2f} s", f"{cs.estimated_seconds:.2f} s"]],
    )
    hosts = sorted(set(s.host_ingress) | set(s.host_egress), key=_host_key)
    busiest = sorted(hosts, key=lambda h: -max(s.host_ingress.get(h, 0), s.host_egress.get(h, 0)))[:8]
    if busiest:
        print_table(
            f"busiest hosts (of {len(hosts)} with cross-host traffic)",
            ["host", "ingress", "egress", "within host"],
            [
                [
                    h,
                    human_bytes(s.host_ingress.get(h, 0)),
                    human_bytes(s.host_egress.get(h, 0)),
                    human_bytes(s.host_local.get(h, 0)),
                ]
                for h in busiest
            ],
        )
    if s.cross_host:
        print(
            f"central moves {cs.cross_host / s.cross_host:.2f}x the cross-host bytes and takes "
            f"{cs.estimated_seconds / max(s.estimated_seconds, 1e-12):.2f}x the estimated time"
        )
    numbered = data["assignment"]["cross_host_by_numbering"]
    if numbered != s.cross_host:
        print(
            f"ranks matched to the devices holding their state: {human_bytes(s.cross_host)} across hosts "
            f"instead of {human_bytes(numbered)} with devices in numbering order"
        )
    if p.unrecoverable:
        names = sorted({t for t, _ in p.unrecoverable})
        print(
            f"UNRECOVERABLE: {len(p.unrecoverable)} boxes of {len(names)} tensors have no surviving copy, "
            f"e.g. {names[0]} {p.unrecoverable[0][1]}"
        )


def _host_key(h: str) -> tuple[int, str]:
    return (int(h[1:]) if h[1:].isdigit() else 1 << 30, h)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    p, c, by_numbering = build_plans(args)
    data = report(p, c, by_numbering, args, time.perf_counter() - started)
    if args.json:
        print(json.dumps(data))
    else:
        print_report(p, c, data)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "plan",
        help="explain a reconfiguration: bytes kept, moved within and across hosts, vs the central baseline",
        description="Plan the state transformation of a GPT model between two (dp, tp, pp) layouts.",
    )
    cmd.add_argument("--model", required=True, help="preset name, e.g. gpt3-2.7b or tiny")
    cmd.add_argument("--from", dest="source", required=True, metavar="LAYOUT", help="e.g. dp=1,tp=4,pp=2")
    cmd.add_argument("--to", dest="target", required=True, metavar="LAYOUT", help="e.g. dp=2,tp=4,pp=2")
    cmd.add_argument("--devices", type=int, help="number of new devices (checked against --to)")
    cmd.add_argument("--devices-per-host", type=int, default=8, help="devices of one host, old and new")
    cmd.add_argument(
        "--lost-hosts",
        type=_int_list,
        default=[],
        metavar="I,J",
        help="indices of old hosts that failed (their state is gone)",
    )
    cmd.add_argument("--redeploy", action="store_true", help="the new layout runs on disjoint, fresh hosts")
    cmd.add_argument(
        "--assign",
        choices=("match", "numbering"),
        default="match",
        help="match ranks to the devices holding their state (default, as `tenplex run` does), "
        "or take the new devices in numbering order",
    )
    cmd.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage of the job")
    cmd.add_argument("--network-gbps", type=float, default=12.5, help="GB/s per host and direction")
    cmd.add_argument("--local-gbps", type=float, default=9.0, help="GB/s of a copy within a host")
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(func=run)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated host indices, got {text!r}") from None
