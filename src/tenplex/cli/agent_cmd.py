"""`tenplex agent` (one per host, torchrun's flags), `tenplex rendezvous`, `tenplex status` and `stop`.

`status` and `stop` serve both kinds of job: with a RUN_DIR, a `tenplex run`'s (its cluster.json); without,
an agent job's, through its rendezvous endpoint."""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

from ..deploy.agent import parse_nodes
from ..ptc import TenplexError

RDZV_PORT = 29400


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run this host's part of an elastic job (a torchrun replacement)")
    _agent_args(p)
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
        _rdzv_args(q)
        if name == "status":
            q.add_argument("--json", action="store_true", help="one JSON object instead of the table")
        q.set_defaults(func=func)


def _agent_args(p: argparse.ArgumentParser) -> None:
    """torchrun's flags where they mean the same, then tenplex's, then the script."""
    _rdzv_args(p)
    p.add_argument("--nnodes", default="1", help="MIN:MAX agents the job accepts (or N)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="workers on this host")
    p.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        default="c10d",
        choices=("c10d", "etcd", "etcd-v2"),
        help="torch's rendezvous backend (default c10d)",
    )
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        help="k=v,... for torch's rendezvous (e.g. last_call_timeout=1,is_host=false)",
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=3,
        help="rounds whose workers failed on a host that stayed, before the job stops",
    )
    p.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=0.1,
        help="seconds between the agent's looks at its workers and the rendezvous",
    )
    _store_args(p)
    p.add_argument("-m", "--module", action="store_true", help="run TARGET as a module (python -m)")
    p.add_argument("script", metavar="TARGET", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")


def _store_args(p: argparse.ArgumentParser) -> None:
    """The host's store, its replicas and its durable tier."""
    p.add_argument("--store", default=None, help="attach to this store URL instead of starting one")
    p.add_argument("--store-port", type=int, default=7070, help="port of the store the agent starts")
    p.add_argument("--store-memory", default="8GiB", help="most bytes the store holds (default 8GiB)")
    p.add_argument(
        "--advertise",
        default="127.0.0.1",
        help="this host's address as the other hosts reach it (store, process group)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="copies of each snapshot on the next hosts of the ring (default 1; 0: none)",
    )
    p.add_argument(
        "--token-file", default=None, help="the stores' shared token (default ~/.tenplex/store.token)"
    )
    p.add_argument(
        "--persist-every",
        type=int,
        default=0,
        help="also write every Nth committed snapshot as a DCP checkpoint to --persist-dir (0: never)",
    )
    p.add_argument(
        "--persist-dir",
        default=None,
        help="where those checkpoints go (every host's agent must see the same directory: a shared file "
        "system); the workers fall back to the newest when no store holds the job's state",
    )
    p.add_argument("--run-dir", default=None, help="records and logs (default tenplex-agent-RDZV_ID)")
    p.add_argument("--keep-store", action="store_true", help="leave the store running when the job ends")


def _rdzv_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=f"127.0.0.1:{RDZV_PORT}",
        help=f"HOST:PORT of the rendezvous store (default 127.0.0.1:{RDZV_PORT})",
    )
    p.add_argument("--rdzv-id", "--rdzv_id", default="tenplex", help="the job's id")


def _conf(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise TenplexError(f"--rdzv-conf: expected key=value, got {item!r}")
        out[k.strip()] = v.strip()
    return out


def _agent(args: argparse.Namespace) -> int:
    from ..runtime.agent import Agent, AgentConfig

    if args.nproc_per_node < 1 or args.replicas < 0 or args.persist_every < 0:
        raise TenplexError("--nproc-per-node must be >= 1, --replicas and --persist-every >= 0")
    if args.persist_every and not args.persist_dir:
        raise TenplexError("--persist-every needs --persist-dir (where the checkpoints go)")
    low, high = parse_nodes(args.nnodes, "--nnodes")
    target = (["-m"] if args.module else []) + [args.script, *args.script_args]
    cfg = AgentConfig(
        target=target,
        run_id=args.rdzv_id,
        endpoint=args.rdzv_endpoint,
        min_nodes=low,
        max_nodes=high,
        nproc=args.nproc_per_node,
        backend=args.rdzv_backend,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        rdzv_conf=_conf(args.rdzv_conf),
        store=args.store,
        store_port=args.store_port,
        store_memory=args.store_memory,
        advertise=args.advertise,
        replicas=args.replicas,
        token_file=args.token_file,
        run_dir=args.run_dir or f"tenplex-agent-{args.rdzv_id}",
        keep_store=args.keep_store,
        persist_every=args.persist_every,
        persist_dir=args.persist_dir,
    )
    return Agent(cfg).run()


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
    for entry in known_stores(base, args.rdzv_id):
        key = job_key(args.rdzv_id, "agent", entry.url)
        if has(base, key):
            agents.append({**get_json(base, key), "incarnation": entry.incarnation})
    return base, agents


def _status(args: argparse.Namespace) -> int:
    from ..util import print_table

    if args.run_dir:
        from .rundir_view import print_status

        return print_status(args.run_dir, args.json)
    _, agents = _job(args)
    if not agents:
        raise TenplexError(f"no agent of job {args.rdzv_id!r} reported to {args.rdzv_endpoint}")
    if args.json:
        print(json.dumps({"job": args.rdzv_id, "agents": agents}))
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
            f"{now - a['time']:.0f}s ago",
        ]
        for a in agents
    ]
    newest = max(a["round"] for a in agents)
    print_table(
        f"job {args.rdzv_id}: round {newest}",
        ["host", "store", "incarnation", "round", "node", "world", "seen"],
        rows,
    )
    return 0


def _stop(args: argparse.Namespace) -> int:
    from ..runtime.rounds import job_key

    if args.run_dir:
        from pathlib import Path

        from ..runtime.rundir import stop

        print(stop(Path(args.run_dir)))
        return 0

    base, agents = _job(args)
    base.set(job_key(args.rdzv_id, "stop"), json.dumps({"time": time.time()}))
    print(f"job {args.rdzv_id}: stop requested ({len(agents)} agents saw the job); they save and end")
    return 0
