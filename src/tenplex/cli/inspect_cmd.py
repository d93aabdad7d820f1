"""`tenplex inspect`: what a snapshot holds — tensors, layout, sizes, where every piece and replica lives."""

from __future__ import annotations

import argparse
import json

from ..ptc import PTC, PTCError
from ..util import human_bytes, print_table
from .args import add_store_args, store_client


def run(args: argparse.Namespace) -> int:
    c = store_client(args.store, args.token_file)
    step = args.step if args.step is not None else c.latest(args.job)
    if step is None:
        raise PTCError(f"job {args.job!r} has no committed version in {c.url}")
    manifest = c.manifest(args.job, step)
    if not isinstance(manifest, dict) or "ptc" not in manifest:
        raise PTCError(f"version {step} of job {args.job!r} is not a tenplex snapshot")
    ptc = PTC.from_json(manifest["ptc"])
    hosts = ptc.mesh.hosts
    copies = {b["name"]: b["copies"] for b in c.blobs(args.job, step)}
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
        info = {"job": args.job, "step": step, "stores": manifest.get("stores")}
        info |= {"replicas": manifest.get("replicas"), "values": sorted(ptc.values), "pieces": rows}
        print(json.dumps(info))
        return 0
    print(
        f"{args.job} @ step {step}: {len(ptc.tensors)} tensors, {human_bytes(ptc.total_bytes)} of state, "
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
    p.add_argument("--job", required=True, help="the job name the snapshots were saved under")
    p.add_argument("--step", type=int, default=None, help="version (default: the newest committed)")
    add_store_args(p)
    p.add_argument("--limit", type=int, default=40, help="rows to show")
    p.add_argument("--all", action="store_true", help="show every piece")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
