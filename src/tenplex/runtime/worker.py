"""One rank of an elastic job: build the layout, load the newest snapshot, train, snapshot, stop on request.

Started by the controller (local processes) or by torchrun; everything it needs comes from the
environment (RANK, WORLD_SIZE, MASTER_*, TENPLEX_STORE, TENPLEX_DEVICE) and a JSON spec
(TENPLEX_WORKER_SPEC or --spec): the training config, the job name, the step to stop at, the snapshot
interval and where to write records. Under torchrun without a layout in the spec, the layout is chosen
for WORLD_SIZE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tenplex

from ..train.config import TrainConfig
from ..train.worker import Trainer, init_distributed
from ..transformer import NoSnapshotError
from .records import Records


def _sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def _stop_requested(path: str | None) -> bool:
    """Rank 0 looks for the stop file; all ranks agree through one all-reduce, so they stop together."""
    flag = torch.tensor([1.0 if path and dist.get_rank() == 0 and os.path.exists(path) else 0.0])
    dist.all_reduce(flag)
    return bool(flag.item())


def run(spec: dict[str, Any]) -> int:
    cfg = TrainConfig(**spec["train"])
    if spec.get("choose", False):
        from .chooser import choose

        best = choose(cfg.model, int(os.environ["WORLD_SIZE"]), cfg.global_batch, table=spec.get("table"))
        cfg.dp, cfg.tp, cfg.pp = best.dp, best.tp, best.pp
    init_distributed(cfg.device)
    rank = dist.get_rank()
    job, until, every = spec["job"], int(spec["until"]), int(spec.get("snapshot_every", 0))
    out = Path(spec["out"])
    rec = Records(out / "worker.jsonl") if rank == 0 else None
    started = time.perf_counter()
    trainer = Trainer(cfg)
    built = time.perf_counter()
    state = trainer.state_dict()
    saved = -1  # the newest step committed by this job that this process knows of
    try:
        info = tenplex.load(state, job=job, path=spec.get("durable"))
        trainer.load_state_dict(state)
        saved = trainer.step
        moved = _sum_over_ranks(info.bytes)
        if rec:
            rec.write(
                "loaded",
                step=trainer.step,
                seconds=info.seconds,
                bytes=moved,
                source=info.source,
                plan=info.plan_bytes,
                lost_stores=info.lost_stores,
                layout=str(cfg.layout),
            )
    except NoSnapshotError:
        if rec:
            rec.write("fresh", step=0, layout=str(cfg.layout))
    if rec:
        rec.write(
            "ready",
            step=trainer.step,
            build_seconds=built - started,
            layout=str(cfg.layout),
            pid=os.getpid(),
            world=dist.get_world_size(),
            sampler=trainer.sampler.state_dict(),
        )
    coords = (trainer.pp_rank, trainer.dp_rank, trainer.tp_rank)
    ledger = Records(out / f"ledger-dp{trainer.dp_rank}.jsonl") if coords[0] == 0 and coords[2] == 0 else None
    pending = None
    stop_file = spec.get("stop_file")
    pace = float(spec.get("min_step_seconds", 0))  # emulates slower devices (tests, demos)
    while trainer.step < until and not _stop_requested(stop_file):
        ids = trainer.sampler.rank_ids(cfg.dp, trainer.dp_rank).tolist() if ledger else None
        t_step = time.perf_counter()
        m = trainer.train_step()
        if pace:
            time.sleep(max(0.0, pace - (time.perf_counter() - t_step)))
        if ledger:
            ledger.write("samples", step=m.step, dp=trainer.dp_rank, ids=ids)
        if rec:
            rec.write("step", **asdict(m), tokens_per_s=m.tokens_per_s)
        if every and trainer.step % every == 0 and trainer.step < until:
            if pending is not None:
                pending.wait()
            t = time.perf_counter()
            pending = tenplex.save(trainer.state_dict(), job=job, step=trainer.step, async_save=True, keep=3)
            saved = trainer.step
            if rec:
                rec.write("snapshot", step=trainer.step, stall=time.perf_counter() - t, mode="async")
    if pending is not None:
        pending.wait()
    if spec.get("save_at_end", True):
        if trainer.step == saved:
            # loaded (a torchrun restart after the end) or snapshotted at this step: a committed version
            # cannot be written again, and it already holds this state
            if rec:
                rec.write("saved", step=trainer.step, seconds=0.0, bytes=0, already=True)
        else:
            t = time.perf_counter()
            h = tenplex.save(trainer.state_dict(), job=job, step=trainer.step, keep=3)
            if rec:
                rec.write("saved", step=trainer.step, seconds=time.perf_counter() - t, bytes=h.bytes_written)
    if rec:
        rec.write("done", step=trainer.step)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of a tenplex elastic job")
    p.add_argument("--spec", help="path of the JSON spec (default: $TENPLEX_WORKER_SPEC)")
    args = p.parse_args(argv)
    path = args.spec or os.environ.get("TENPLEX_WORKER_SPEC")
    if not path:
        print("tenplex worker: no spec (--spec or TENPLEX_WORKER_SPEC)", file=sys.stderr)
        return 2
    return run(json.loads(Path(path).read_text()))


if __name__ == "__main__":
    sys.exit(main())
