"""`tenplex import`: a framework's own checkpoint as a snapshot of a job in the stores, for the job to resume
from in any layout: DeepSpeed's (tenplex.integrations.deepspeed_import) and Megatron's torch_dist
(tenplex.integrations.megatron_checkpoint)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="a framework's checkpoint into the stores, as a snapshot of a job")
    frameworks = p.add_subparsers(dest="framework", required=True)
    ds = frameworks.add_parser(
        "deepspeed",
        help="a DeepSpeed checkpoint (universal, or ZeRO 1/2/3's global_stepN folder) for DeepSpeedState",
    )
    ds.add_argument("folder", help="the checkpoint folder: universal (zero/ inside) or global_stepN")
    ds.add_argument("--job", required=True, help="the job the snapshot belongs to (its script's job name)")
    ds.add_argument("--step", type=int, default=None, help="the snapshot's step (default: the checkpoint's)")
    ds.add_argument("--store", default=None, help="store URL (default $TENPLEX_STORE or the local store)")
    ds.set_defaults(func=run_deepspeed)
    register_megatron(frameworks)


def register_megatron(frameworks: argparse._SubParsersAction) -> None:
    mg = frameworks.add_parser(
        "megatron",
        help="a Megatron torch_dist checkpoint (dist_checkpointing.save of a model), without the model",
    )
    mg.add_argument("folder", help="the checkpoint folder (metadata.json, common.pt, .metadata inside)")
    mg.add_argument("--job", required=True, help="the job the snapshot belongs to (its script's job name)")
    mg.add_argument(
        "--step", type=int, default=None, help="the snapshot's step (default: N of iter_N, else 0)"
    )
    mg.add_argument("--store", default=None, help="store URL (default $TENPLEX_STORE or the local store)")
    mg.set_defaults(func=run_megatron)


def run_deepspeed(args: argparse.Namespace) -> int:
    from ..integrations.deepspeed_import import import_checkpoint  # torch: only when the command runs

    step = import_checkpoint(args.folder, args.job, step=args.step, store=args.store)
    print(f"imported {args.folder} as job {args.job} step {step}")
    return 0


def run_megatron(args: argparse.Namespace) -> int:
    from ..integrations.megatron_checkpoint import import_checkpoint  # torch: only when the command runs

    step = import_checkpoint(args.folder, args.job, step=args.step, store=args.store)
    print(f"imported {args.folder} as job {args.job} step {step}")
    return 0
