"""`tenplex export`: a job's snapshot in the stores written in a framework's own checkpoint format, for the
framework's own loader. DeepSpeed's universal checkpoint for now (tenplex.integrations.deepspeed_export)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a job's snapshot from the stores, in a framework's checkpoint format")
    frameworks = p.add_subparsers(dest="framework", required=True)
    ds = frameworks.add_parser(
        "deepspeed",
        help="a snapshot saved with DeepSpeedState as a DeepSpeed universal checkpoint (load_universal)",
    )
    ds.add_argument("folder", help="where global_stepN/ and latest_universal are written")
    ds.add_argument("--job", required=True, help="the job whose snapshot is exported")
    ds.add_argument("--step", type=int, default=None, help="the snapshot's step (default: the newest)")
    ds.add_argument("--store", default=None, help="store URL (default $TENPLEX_STORE or the local store)")
    ds.set_defaults(func=run_deepspeed)


def run_deepspeed(args: argparse.Namespace) -> int:
    from ..integrations.deepspeed_export import export_checkpoint  # torch: only when the command runs

    out = export_checkpoint(args.job, args.folder, step=args.step, store=args.store)
    print(f"exported job {args.job} as {out} (a DeepSpeed universal checkpoint)")
    return 0
