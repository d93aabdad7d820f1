"""torchrun / TorchElastic entry point: the elastic worker with its spec given as flags.

    torchrun --nnodes=1:2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        --rdzv-id=JOB --max-restarts=5 -m tenplex.runtime.elastic --model tiny --steps 40 --job JOB --out DIR

torchrun owns membership: when an agent (a node) joins or leaves, it stops every worker and starts them
again with the new WORLD_SIZE. Nothing is kept in the processes, so each start is the same: choose the
(dp, tp, pp) for this WORLD_SIZE (or take it from --table), build empty tensors in that layout, load the
newest committed snapshot from the stores into them, continue. Steps since that snapshot are replayed, so
--snapshot-every bounds the work a membership change costs. Each agent is a host: its environment names
its store (TENPLEX_STORE) and every store a snapshot may be in (TENPLEX_SOURCES).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import asdict

from ..train.config import add_train_args, config_from_args
from .spec import WorkerSpec
from .tables import read_table


def build_spec(argv: list[str] | None = None) -> WorkerSpec:
    """The worker spec from command-line flags; no layout: the rank chooses one for its WORLD_SIZE."""
    p = argparse.ArgumentParser(
        prog="python -m tenplex.runtime.elastic",
        description="one rank of a tenplex job under torchrun (c10d rendezvous, elastic membership)",
    )
    add_train_args(p)
    p.add_argument("--job", required=True, help="job name in the stores (the same on every start)")
    p.add_argument("--out", required=True, help="directory for records (worker.jsonl, ledgers)")
    p.add_argument("--snapshot-every", type=int, default=2, help="async snapshot every N steps (0: never)")
    p.add_argument("--until", type=int, default=0, help="stop at this step (0: --steps)")
    p.add_argument("--table", default=None, help="para-config file (JSON or YAML): devices -> {dp, tp, pp}")
    p.add_argument("--durable", default=None, help="persisted DCP snapshot to fall back to")
    p.add_argument("--stop-file", default=None, help="stop (and save) at the next step once this exists")
    p.add_argument("--fresh", action="store_true", help="start at step 0 though stores may be lost")
    p.add_argument("--min-step-seconds", type=float, default=0.0, help="pace steps (emulates slower devices)")
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    cfg.dp = cfg.tp = cfg.pp = 1  # chosen per WORLD_SIZE in the rank
    return WorkerSpec(
        job=args.job,
        until=args.until or cfg.steps,
        snapshot_every=args.snapshot_every,
        out=args.out,
        stop_file=args.stop_file,
        durable=args.durable,
        train=asdict(cfg),
        table=read_table(args.table, "para-config") if args.table else None,
        min_step_seconds=args.min_step_seconds,
        fresh=args.fresh,
    ).placed()


COMMIT_GRACE_S = 10.0


def _finish_commits_then_exit(signum: int, frame: object) -> None:
    """torchrun stops workers with SIGTERM on every membership change. A snapshot whose commit is under
    way is let finish (bounded), so that no version ends up committed on some stores and not on others;
    then the process exits at once (no interpreter teardown that could wait on dead peers)."""
    from ..transformer.save import wait_for_pending

    wait_for_pending(COMMIT_GRACE_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    spec = build_spec(argv)
    if "WORLD_SIZE" not in os.environ:
        print("tenplex elastic: run me under torchrun (WORLD_SIZE is not set)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _finish_commits_then_exit)
    from .reference_rank import run

    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
