"""`tenplex store`: run this host's tensor store daemon; `tenplex store ls`: a store's contents."""

from __future__ import annotations

import argparse
import json

from ..store.main import add_arguments, run
from ..util import human_bytes, print_table
from .args import add_store_args, store_client


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("store", help="run the tensor store daemon of this host (or list its contents)")
    add_arguments(p)
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="store_action", required=False, parser_class=type(p))
    ls = actions.add_parser("ls", help="jobs, versions, blobs, sizes and copies held by a store")
    add_store_args(ls, token_dest="ls_token_file")
    ls.add_argument("--blobs", action="store_true", help="one row per blob instead of one per version")
    ls.add_argument("--datasets", action="store_true", help="list registered datasets (read-only views)")
    ls.add_argument("--json", action="store_true", help="print one JSON object (with --blobs: each version's "
                    "blobs in blob_list)")  # fmt: skip
    ls.set_defaults(func=_ls)


def _ls(args: argparse.Namespace) -> int:
    c = store_client(args.store, args.ls_token_file)
    if args.datasets:
        datasets = c.datasets()
        if args.json:
            print(json.dumps({"store": c.url, "datasets": datasets}))
            return 0
        ds = [[d["name"], d["split"], str(d["seq"]), str(d["num_samples"]), human_bytes(d["nbytes"]),
               d["corpus"]] for d in datasets]  # fmt: skip
        print_table(f"{c.url}: datasets", ["dataset", "split", "seq", "samples", "size", "corpus"], ds)
        return 0
    versions = [{"job": job, **v} for job in c.jobs() for v in c.version_info(job)]
    if args.blobs:
        for v in versions:
            if v["committed"]:
                v["blob_list"] = c.blobs(v["job"], v["step"])
    s = c.stats()
    if args.json:
        print(json.dumps({"store": c.url, "memory_used": s["memory_used"], "memory_limit": s["memory_limit"],
                          "versions": versions}))  # fmt: skip
        return 0
    title = f"{c.url}: {human_bytes(s['memory_used'])} of {human_bytes(s['memory_limit'])} used"
    if args.blobs:
        header = ["job", "version", "blob", "type", "size", "copies"]
    else:
        header = ["job", "version", "state", "blobs", "size", "replication"]
    print_table(title, header, [row for v in versions for row in _rows(v)])
    return 0


def _rows(v: dict) -> list[list[str]]:
    """One row per version, or one per blob of a committed version listed with --blobs."""
    if "blob_list" in v:
        return [[v["job"], str(v["step"]), b["name"], f"{b['dtype']}{b['shape']}", human_bytes(b["nbytes"]),
                 ", ".join(b["copies"])] for b in v["blob_list"]]  # fmt: skip
    state = "committed" if v["committed"] else "pending"
    if v["replica_of"]:
        state += f" (replica of {v['replica_of']})"
    return [[v["job"], str(v["step"]), state, str(v["blobs"]), human_bytes(v["nbytes"]), v["replication"]]]
