"""`tenplex agent` (one per host, torchrun's flags), `tenplex rendezvous`, `tenplex status`, `stop` and
`devices` (a host's devices change: one lost, or added, while the host stays), `layout` (the layout the
job takes, without a change of its devices) and `admit` (a warm spare, `tenplex agent --standby`, joins).
`--at-step S` on `stop`, `devices`, `layout` and `admit` lands the job's planned changes at step S (the
round trains to it, saves it and re-forms); without it they land at the workers' next step boundary.

`status` and `stop` serve both kinds of job: with a RUN_DIR, a `tenplex run`'s (its cluster.json); without,
an agent job's, through its rendezvous endpoint."""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

from ..ptc import TenplexError
from ..runtime.agentconfig import RDZV_PORT, AgentConfig
from ..util.flags import add_flags, from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run this host's part of an elastic job (a torchrun replacement)")
    add_flags(p, AgentConfig)
    p.set_defaults(func=_agent)

    r = sub.add_parser("rendezvous", help="host a job's rendezvous endpoint apart from the agents")
    r.add_argument("--host", default="0.0.0.0", help="address to bind (default all)")
    r.add_argument("--port", type=int, default=RDZV_PORT, help=f"port (default {RDZV_PORT})")
    r.set_defaults(func=_rendezvous)

    for name, text, func in (
        (
            "status",
            "a run's job, layout, step and stores (RUN_DIR), or an agent job's agents and round",
            _status,
        ),
        (
            "stop",
            "stop a run's stores and what it left running (RUN_DIR), or an agent job after a save",
            _stop,
        ),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument("run_dir", metavar="RUN_DIR", nargs="?",
                       help="a `tenplex run` directory (its cluster.json); without it, the agent job "
                       "named by --rdzv-endpoint and --rdzv-id")  # fmt: skip
        add_flags(q, AgentConfig, only=("endpoint", "run_id"))
        if name == "status":
            q.add_argument("--json", action="store_true", help="one JSON object instead of the table")
        else:
            _at_step(q)
        q.set_defaults(func=func)

    d = sub.add_parser("devices", help="change the devices of one host of an agent job (at a step boundary)")
    d.add_argument(
        "host", metavar="HOST", help="the agent's store URL or address (as `tenplex status` shows)"
    )
    d.add_argument("devices", metavar="DEVICES", help="the device indices its workers run on, e.g. 0,2,3")
    add_flags(d, AgentConfig, only=("endpoint", "run_id"))
    _at_step(d)
    d.add_argument("--failed", action="store_true",
                   help="the devices left out failed: their workers are killed now (not at a step "
                   "boundary) and the job goes on without them from its newest snapshot")  # fmt: skip
    d.set_defaults(func=_devices)

    a = sub.add_parser("admit", help="let a warm spare (`tenplex agent --standby`) join an agent job")
    a.add_argument("host", metavar="STORE_URL", help="the spare's store URL (--advertise, --store-port)")
    add_flags(a, AgentConfig, only=("endpoint", "run_id"))
    _at_step(a)
    a.set_defaults(func=_admit)

    lay = sub.add_parser("layout", help="ask an agent job for a layout (at a step boundary), or `auto`")
    lay.add_argument("layout", metavar="LAYOUT", help="dp=2,tp=2,pp=1 (taken by worlds it fits), or auto")
    add_flags(lay, AgentConfig, only=("endpoint", "run_id"))
    _at_step(lay)
    lay.set_defaults(func=_layout)


def _at_step(p: argparse.ArgumentParser) -> None:
    p.add_argument("--at-step", type=_step, default=None, metavar="S",
                   help="the job trains to step S, saves it and changes there (a step already past: at "
                   "once); every planned change waits for S, a host's join or leave too. Without it: "
                   "at the workers' next step boundary")  # fmt: skip


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer, got {text!r}")
    return int(text)


def _when(args: argparse.Namespace) -> str:
    return "at the workers' next step boundary" if args.at_step is None else f"after step {args.at_step}"


def _ask_at(base: Any, args: argparse.Namespace) -> None:
    """The step the ask lands at, written before the ask itself (no agent sees one without the other)."""
    from ..runtime.asked import ask_at

    ask_at(base, args.rdzv_id, args.at_step)


def _conf(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise TenplexError(f"--rdzv-conf: expected key=value, got {item!r}")
        out[k.strip()] = v.strip()
    return out


def _agent(args: argparse.Namespace) -> int:
    from ..runtime.agent import Agent

    return Agent(from_args(AgentConfig, args, rdzv_conf=_conf(args.rdzv_conf))).run()


def _rendezvous(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            args.host, args.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
    except RuntimeError as e:
        raise TenplexError(f"cannot serve a rendezvous on {args.host}:{args.port}: {e}") from None
    ends = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, ends)
    print(f"tenplex rendezvous listening on {args.host}:{store.port}", flush=True)
    signal.sigwait(ends)  # the store serves from its own thread until then
    return 0


def _job(args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    from ..runtime.rounds import connect, get_json, has, job_key, known_stores

    base = connect(args.rdzv_endpoint, timeout=10)
    agents = []
    newest = {e.url: e for e in known_stores(base, args.rdzv_id)}  # a store restarted on its port: once
    for entry in newest.values():
        key = job_key(args.rdzv_id, "agent", entry.url)
        if has(base, key):
            agents.append({**get_json(base, key), "incarnation": entry.incarnation})
    return base, agents


def _status(args: argparse.Namespace) -> int:
    from ..util import print_table

    if args.run_dir:
        from .rundir_view import print_status

        return print_status(args.run_dir, args.json)
    from ..runtime.asked import asked_at, spares

    base, agents = _job(args)
    waiting = spares(base, args.rdzv_id)
    if not agents and not waiting:
        raise TenplexError(f"no agent of job {args.rdzv_id!r} reported to {args.rdzv_endpoint}")
    at = asked_at(base, args.rdzv_id)
    if args.json:
        print(json.dumps({"job": args.rdzv_id, "agents": agents, "spares": waiting, "at_step": at}))
        return 0
    if waiting:
        print(f"warm spares waiting to be let in (tenplex admit STORE_URL): {', '.join(waiting)}")
    if not agents:
        return 0
    now = time.time()
    rows = [
        [
            a["host"],
            a["store"],
            a["incarnation"][:8],
            str(a["round"]),
            f"{a['node']}/{a['nodes']}",
            str(a["world"]),
            ",".join(map(str, a.get("devices", []))),
            f"{now - a['time']:.0f}s ago",
        ]
        for a in agents
    ]
    newest = max(a["round"] for a in agents)
    print_table(
        f"job {args.rdzv_id}: round {newest}" + ("" if at is None else f", planned changes at step {at}"),
        ["host", "store", "incarnation", "round", "node", "world", "devices", "seen"],
        rows,
    )
    return 0


def _stop(args: argparse.Namespace) -> int:
    from ..runtime.asked import ask_stop

    if args.run_dir:
        from pathlib import Path

        from ..runtime.rundir import stop

        if args.at_step is not None:
            raise TenplexError("--at-step is for an agent job; a `tenplex run` stops where its schedule ends")
        print(stop(Path(args.run_dir)))
        return 0

    base, agents = _job(args)
    _ask_at(base, args)
    ask_stop(base, args.rdzv_id)
    print(f"job {args.rdzv_id}: stop requested ({len(agents)} agents saw the job); they save and end "
          f"{_when(args)}")  # fmt: skip
    return 0


def _devices(args: argparse.Namespace) -> int:
    from ..runtime.agentconfig import parse_devices
    from ..runtime.asked import ask_devices, waits

    wanted = parse_devices(args.devices)
    base, agents = _job(args)
    found = [a for a in agents if args.host in (a["store"], a["host"])]
    if not found and not args.failed and waits(base, args.rdzv_id, args.host):  # a spare, not let in yet
        ask_devices(base, args.rdzv_id, args.host, wanted)
        print(f"job {args.rdzv_id}: the spare at {args.host} joins with devices {wanted}")
        return 0
    if not found:
        named = ", ".join(a["store"] for a in agents) or "none"
        raise TenplexError(f"job {args.rdzv_id}: no agent at {args.host!r} (its agents' stores: {named})")
    if len(found) > 1:
        named = ", ".join(a["store"] for a in found)
        raise TenplexError(f"job {args.rdzv_id}: {len(found)} agents at {args.host!r}; name a store: {named}")
    agent = found[0]
    had = list(agent.get("devices", []))
    if args.failed:
        if args.at_step is not None:
            raise TenplexError("--failed takes effect at once; it has no --at-step")
        failed = [d for d in had if d not in wanted]
        if not failed or not set(wanted) <= set(had):
            raise TenplexError(f"--failed: name the devices that stay, a part of {had} (got {wanted})")
        ask_devices(base, args.rdzv_id, agent["store"], wanted, failed=failed)
        print(f"job {args.rdzv_id}: {agent['store']} devices {failed} failed; the job goes on with {wanted}")
        return 0
    _ask_at(base, args)
    ask_devices(base, args.rdzv_id, agent["store"], wanted)
    print(f"job {args.rdzv_id}: {agent['store']} goes from devices {had} to {wanted} {_when(args)}")
    return 0


def _admit(args: argparse.Namespace) -> int:
    from ..runtime.asked import admit, waits
    from ..runtime.rounds import connect

    base = connect(args.rdzv_endpoint, timeout=10)
    if not waits(base, args.rdzv_id, args.host):
        raise TenplexError(f"job {args.rdzv_id}: no spare waits at {args.host} (start one: tenplex agent "
                           "--standby ... --advertise ADDR --store-port PORT)")  # fmt: skip
    _ask_at(base, args)
    admit(base, args.rdzv_id, args.host)
    print(f"job {args.rdzv_id}: {args.host} joins {_when(args)}")
    return 0


def _layout(args: argparse.Namespace) -> int:
    from ..ptc.layout import parse_layout
    from ..runtime.asked import ask_layout

    auto = args.layout == "auto"
    text = "" if auto else ",".join(f"{k}={v}" for k, v in parse_layout(args.layout).items())
    base, agents = _job(args)
    if not agents:
        raise TenplexError(f"no agent of job {args.rdzv_id!r} reported to {args.rdzv_endpoint}")
    _ask_at(base, args)
    ask_layout(base, args.rdzv_id, text)
    what = "each world's own layout" if auto else f"{text} wherever the world fits it"
    print(f"job {args.rdzv_id}: {what}, {_when(args)}")
    return 0
