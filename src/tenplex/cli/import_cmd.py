"""`tenplex import`: a framework's own checkpoint as a snapshot of a job in the stores, for the job to resume
from in any layout: DeepSpeed's (tenplex.integrations.deepspeed_import) and Megatron's torch_dist
(tenplex.integrations.megatron_checkpoint)."""

from __future__ import annotations

import argparse
from importlib import import_module

# framework: (its importer's module, what it reads, the folder, the default step)
FORMATS = {
    "deepspeed": (
        "deepspeed_import",
        "a DeepSpeed checkpoint (universal, or ZeRO 1/2/3's global_stepN folder) for DeepSpeedState",
        "the checkpoint folder: universal (zero/ inside) or global_stepN",
        "the checkpoint's",
    ),
    "megatron": (
        "megatron_checkpoint",
        "a Megatron torch_dist checkpoint (dist_checkpointing.save of a model), without the model",
        "the checkpoint folder (metadata.json, common.pt, .metadata inside)",
        "N of iter_N, else 0",
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import", help="a framework's checkpoint into the stores, as a snapshot of a job")
    frameworks = p.add_subparsers(dest="framework", required=True)
    for name, (_, what, folder, step) in FORMATS.items():
        f = frameworks.add_parser(name, help=what)
        f.add_argument("folder", help=folder)
        f.add_argument("--job", required=True, help="the job the snapshot belongs to (its script's job name)")
        f.add_argument("--step", type=int, default=None, help=f"the snapshot's step (default: {step})")
        f.add_argument("--store", default=None, help="store URL (default $TENPLEX_STORE or the local store)")
        f.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    module = import_module(f"tenplex.integrations.{FORMATS[args.framework][0]}")  # torch: only now
    step = module.import_checkpoint(args.folder, args.job, step=args.step, store=args.store)
    print(f"imported {args.folder} as job {args.job} step {step}")
    return 0
