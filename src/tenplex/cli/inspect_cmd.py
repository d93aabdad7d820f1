"""`tenplex inspect`: what a snapshot holds — tensors, layout, sizes, where every piece and replica lives."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..ptc import PTC, PTCError
from ..runtime.records import Kind
from ..store import StoreClient, StoreError
from ..util import human_bytes, print_table
from .args import add_store_args, store_client


def run_stores(run_dir: str, job: str | None) -> tuple[str, list[str]]:
    """The job of a `tenplex run` directory (its timeline's start, unless --job names it) and its stores'
    URLs (`cluster.json`)."""
    d = Path(run_dir)
    try:
        stores = json.loads((d / "cluster.json").read_text())["stores"]
    except (OSError, ValueError, KeyError, TypeError):
        raise PTCError(f"--run-dir {run_dir!r}: no cluster.json of a `tenplex run` there") from None
    if job is None:
        for line in (
            (d / "timeline.jsonl").read_text().splitlines() if (d / "timeline.jsonl").exists() else []
        ):
            rec = json.loads(line)
            if rec.get("kind") == Kind.START:
                job = rec["job"]
        if job is None:
            raise PTCError(f"--run-dir {run_dir!r}: its timeline names no job; pass --job")
    if not stores:
        raise PTCError(f"--run-dir {run_dir!r}: none of the run's stores is left (run with --keep-stores)")
    return job, [s["url"] for s in stores.values()]


def newest(args: argparse.Namespace) -> tuple[str, int, StoreClient, list[StoreClient]]:
    """The job, the step to show, the store to read its manifest from, and every store to ask for copies."""
    if args.run_dir:
        if args.store:
            raise PTCError("--run-dir names the run's stores: leave out --store")
        job, urls = run_stores(args.run_dir, args.job)
    elif args.job:
        job, urls = args.job, [args.store]
    else:
        raise PTCError("inspect needs --job (on --store) or --run-dir")
    clients = [store_client(u, args.token_file) for u in urls]
    found = []
    for c in clients:
        try:
            step = args.step if args.step is not None else c.latest(job)
        except StoreError:
            if len(clients) == 1:
                raise
            continue  # a run's store that is gone: the others may hold the snapshot
        if step is not None and (args.step is None or step in c.versions(job)):
            found.append((step, c))
    if not found:
        where = args.run_dir or clients[0].url
        raise PTCError(
            f"job {job!r} has no committed version{'' if args.step is None else f' {args.step}'} in {where}"
        )
    step, c = max(found, key=lambda f: f[0])
    return job, step, c, [c2 for s2, c2 in found if s2 == step]


def run(args: argparse.Namespace) -> int:
    job, step, c, holders = newest(args)
    manifest = c.manifest(job, step)
    if not isinstance(manifest, dict) or "ptc" not in manifest:
        raise PTCError(f"version {step} of job {job!r} is not a tenplex snapshot")
    ptc = PTC.from_json(manifest["ptc"])
    hosts = ptc.mesh.hosts
    copies: dict[str, set[str]] = {}
    for h in holders:
        for b in h.blobs(job, step):
            copies.setdefault(b["name"], set()).update(b["copies"])
    rows = []
    for name, meta in ptc.tensors.items():
        for piece in ptc.pieces(name):
            where = [f"r{r}@{hosts[r]}" for r in piece.holders]
            replicas = sorted({u for r in piece.holders for u in copies.get(f"r{r}/{name}", [])} - set(hosts))
            rows.append(
                {"tensor": name, "dtype": meta.dtype, "shape": list(meta.shape), "box": piece.box.to_json(),
                 "bytes": piece.box.volume * meta.itemsize, "holders": where, "store_replicas": replicas}
            )  # fmt: skip
    if args.json:
        info = {"job": job, "step": step, "stores": manifest.get("stores")}
        info |= {"replicas": manifest.get("replicas"), "values": sorted(ptc.values), "pieces": rows}
        print(json.dumps(info))
        return 0
    print(
        f"{job} @ step {step}: {len(ptc.tensors)} tensors, {human_bytes(ptc.total_bytes)} of state, "
        f"{ptc.mesh.size} ranks on {len(set(hosts))} stores; values: {', '.join(sorted(ptc.values)) or '-'}"
    )
    shown = rows if args.all else rows[: args.limit]
    print_table(
        "pieces (box, size, which ranks on which stores hold it, store replicas)",
        ["tensor", "type", "box", "size", "holders", "replicas"],
        [
            [
                r["tensor"],
                f"{r['dtype']}{r['shape']}",
                _box(r["box"]),
                human_bytes(r["bytes"]),
                ", ".join(r["holders"]),
                ", ".join(r["store_replicas"]) or "-",
            ]
            for r in shown
        ],
    )
    if len(shown) < len(rows):
        print(f"... {len(rows) - len(shown)} more pieces (--all shows them)")
    return 0


def _box(box: list[list[int]]) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="what a snapshot holds: tensors, layout, sizes, holders and replicas")
    p.add_argument("--job", help="the job name the snapshots were saved under (with --run-dir: the run's)")
    p.add_argument("--run-dir", help="a `tenplex run` directory: its job on its stores (cluster.json)")
    p.add_argument("--step", type=int, default=None, help="version (default: the newest committed)")
    add_store_args(p)
    p.add_argument("--limit", type=int, default=40, help="rows to show")
    p.add_argument("--all", action="store_true", help="show every piece")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
