"""`tenplex export`: a job's snapshot written out in a framework's own checkpoint format, for the framework's
own loader: PyTorch DCP for any job (the durable tier's writer, `tenplex.transformer.persist`), Megatron's
torch_dist (tenplex.integrations.megatron_checkpoint) and DeepSpeed's universal checkpoint
(tenplex.integrations.deepspeed_export)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a job's snapshot from the stores into a framework's checkpoint format")
    frameworks = p.add_subparsers(dest="framework", required=True)
    for name, what, folder, func in FORMATS:
        f = frameworks.add_parser(name, help=what)
        f.add_argument("folder", help=folder)
        f.add_argument("--job", required=True, help="the job whose snapshot is written")
        f.add_argument(
            "--step", type=int, default=None, help="the snapshot's step (default: the newest committed)"
        )
        f.add_argument("--store", default=None, help="store URL (default $TENPLEX_STORE or the local store)")
        f.set_defaults(func=func)


def run_dcp(args: argparse.Namespace) -> int:
    from ..transformer import persist  # torch: only when the command runs

    out = persist(args.job, args.step, args.folder, store=args.store)
    print(f"exported job {args.job} step {out['step']} to {args.folder} ({out['bytes']} bytes of tensors)")
    return 0


def run_megatron(args: argparse.Namespace) -> int:
    from ..integrations.megatron_checkpoint import export_checkpoint  # torch: only when the command runs

    out = export_checkpoint(args.job, args.folder, step=args.step, store=args.store)
    left = f"; left out (not a model tensor): {len(out['left_out'])}" if out["left_out"] else ""
    print(f"exported job {args.job} step {out['step']} to {args.folder} ({out['tensors']} tensors{left})")
    return 0


def run_deepspeed(args: argparse.Namespace) -> int:
    from ..integrations.deepspeed_export import export_checkpoint  # torch: only when the command runs

    out = export_checkpoint(args.job, args.folder, step=args.step, store=args.store)
    print(f"exported job {args.job} as {out} (a DeepSpeed universal checkpoint)")
    return 0


FORMATS: list[tuple[str, str, str, Callable[[argparse.Namespace], int]]] = [
    (
        "dcp",
        "any job's snapshot as a DCP checkpoint (torch.distributed.checkpoint.load reads it)",
        "the checkpoint folder to write (replaced atomically if it exists)",
        run_dcp,
    ),
    (
        "megatron",
        "a Megatron model's snapshot as a torch_dist checkpoint (dist_checkpointing.load reads it)",
        "the checkpoint folder to write (must not exist)",
        run_megatron,
    ),
    (
        "deepspeed",
        "a snapshot saved with DeepSpeedState as a DeepSpeed universal checkpoint (load_universal)",
        "where global_stepN/ and latest_universal are written",
        run_deepspeed,
    ),
]
