"""`tenplex plan`: explain a reconfiguration of a model's state before a byte moves."""

from __future__ import annotations

import argparse
import json
import time

from ..planner import Bandwidth, Plan, assign_plan, central_plan, plan
from ..planner.estimate import LINKS, Costs, Estimate, Links, estimate, parse_links
from ..ptc import PTC, Mesh, ModelSpec, PTCError, device_id, model_ptc
from ..ptc.layout import parse_layout
from ..util import human_bytes, print_table
from .args import MODEL_HELP, add_snapshot_args, model_spec, snapshot

DEFAULT_LINKS = ",".join(LINKS)


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


def source(args: argparse.Namespace) -> tuple[str, ModelSpec, PTC]:
    """The model's label, its description and the old PTC: a snapshot's own (`--job`), else the model's
    symbolic PTC in the `--from` layout."""
    if args.job:
        if args.source:
            raise PTCError("--from is the snapshot's own layout with --job: leave it out")
        label, old = snapshot(args)
        spec = model_spec(args.model)[1] if args.model else ModelSpec.from_ptc(old)
        return label, spec, old
    if not args.model or not args.source:
        raise PTCError("the following arguments are required: --model and --from (or --job)")
    label, spec = model_spec(args.model)
    src = parse_layout(args.source)
    dph = args.devices_per_host
    return label, spec, model_ptc(spec, src["dp"], src["tp"], src["pp"], devices_per_host=dph, zero=args.zero)


def build_plans(args: argparse.Namespace) -> tuple[str, Plan, Plan, Plan]:
    """The plan, the central baseline and the plan with devices taken in numbering order."""
    if args.devices_per_host < 1:
        raise PTCError("--devices-per-host must be at least 1")
    label, spec, old = source(args)
    dst = parse_layout(args.target)
    hosts = old.mesh.host_names()
    lost_hosts = set()
    for h in args.lost_hosts:
        if not 0 <= h < len(hosts):
            raise PTCError(f"--lost-hosts {h}: the old layout has hosts 0..{len(hosts) - 1}")
        lost_hosts.add(hosts[h])
    n = dst["dp"] * dst["tp"] * dst["pp"]
    if args.devices is not None and args.devices != n:
        raise PTCError(f"--to {args.target} needs {n} devices, but --devices is {args.devices}")
    devices = allocate_devices(old.mesh, n, args.devices_per_host, lost_hosts, args.redeploy)
    numbered = model_ptc(spec, dst["dp"], dst["tp"], dst["pp"], devices=devices, zero=args.zero)
    bw = Bandwidth(network=args.network_gbps * 1e9, local=args.local_gbps * 1e9)
    if args.assign == "match":
        p, by_numbering = assign_plan(old, numbered, lost_hosts, bw)
    else:
        p = by_numbering = plan(old, numbered, lost_hosts, bw)
    return label, p, central_plan(old, p.new, lost_hosts, bw), by_numbering


def report(
    label: str, p: Plan, c: Plan, by_numbering: Plan, args: argparse.Namespace, seconds: float
) -> dict:
    s = p.stats.to_json()
    out = {
        "model": label,
        "from": parse_layout(args.source) if args.source else {"snapshot": label, "ranks": p.old.mesh.size},
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
    src = "its snapshot's layout" if "snapshot" in data["from"] else str(data["from"])
    print(
        f"{data['model']}: {src} on {data['devices']['old']} devices -> {data['to']} on "
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
        name, box = min(p.unrecoverable, key=lambda u: u[0])  # a name and its own box
        print(
            f"UNRECOVERABLE: {len(p.unrecoverable)} boxes of {len({t for t, _ in p.unrecoverable})} tensors "
            f"have no surviving copy, e.g. {name} {box}"
        )


def _host_key(h: str) -> tuple[int, str]:
    return (int(h[1:]) if h[1:].isdigit() else 1 << 30, h)


def link_choices(args: argparse.Namespace) -> dict[str, Links]:
    """The links --bandwidth names (comma-separated), checked before anything is planned."""
    if args.bandwidth is not None and not args.estimate:
        raise PTCError("--bandwidth names the links of --estimate: add --estimate")
    names = [b.strip() for b in (args.bandwidth or DEFAULT_LINKS).split(",") if b.strip()]
    if not names:
        raise PTCError("--bandwidth: name at least one of " + ", ".join(LINKS) + " or a speed in Gbit/s")
    return {name: parse_links(name) for name in names}


def estimates(p: Plan, args: argparse.Namespace, costs: Costs | None = None) -> dict[str, Estimate]:
    """The projection of the change under each link --bandwidth names."""
    return {name: estimate(p, links, costs) for name, links in link_choices(args).items()}


def print_estimates(projected: dict[str, Estimate]) -> None:
    print_table(
        "projected reconfiguration time (bottleneck model: the busiest host or link decides)",
        ["links", "save", "load", "total", "decided by"],
        [
            [name, f"{e.save_s:.2f} s", f"{e.load_s:.2f} s", f"{e.total_s:.2f} s", e.bottleneck]
            for name, e in projected.items()
        ],
    )
    print("assumptions:")
    links = [e.assumptions[0] for e in projected.values()]  # each estimate names its links first
    shared = next(iter(projected.values())).assumptions[1:]  # the rest: the same costs, the same change
    for a in dict.fromkeys(links + shared):
        print(f"  - {a}")


def run(args: argparse.Namespace) -> int:
    link_choices(args)  # bad --bandwidth: one line before the planning
    started = time.perf_counter()
    label, p, c, by_numbering = build_plans(args)
    data = report(label, p, c, by_numbering, args, time.perf_counter() - started)
    projected = estimates(p, args) if args.estimate else {}
    if projected:
        data["estimate"] = {name: e.to_json() for name, e in projected.items()}
    if args.json:
        print(json.dumps(data))
    else:
        print_report(p, c, data)
        if projected:
            print_estimates(projected)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "plan",
        help="explain a reconfiguration: bytes kept, moved within and across hosts, vs the central baseline",
        description="Plan the state transformation of a model between two (dp, tp, pp) layouts: a GPT "
        "preset, your model's description, or a snapshot on a store (--job) to a new layout.",
    )
    cmd.add_argument("--model", help=MODEL_HELP + "; with --job: how the snapshot's tensors split over tp")
    cmd.add_argument("--from", dest="source", metavar="LAYOUT", help="e.g. dp=1,tp=4,pp=2 (not with --job)")
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
    cmd.add_argument(
        "--estimate",
        action="store_true",
        help="project the change's save + load time on a cluster from the measured costs (docs/scale.md)",
    )
    cmd.add_argument(
        "--bandwidth",
        metavar="LINKS",
        help=f"with --estimate: links to project for, comma-separated: {', '.join(LINKS)} "
        f"or a NIC speed in Gbit/s (default: {DEFAULT_LINKS})",
    )
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    add_snapshot_args(cmd, "plan from")
    cmd.set_defaults(func=run)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated host indices, got {text!r}") from None
