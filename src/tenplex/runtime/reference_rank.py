"""One rank of the reference workload as an elastic job: the GPT `Trainer` driven by `ElasticJob`, plus the
data ledger.

Started by the controller (local processes, a standby pool) or by torchrun (`runtime/elastic.py`); all it
needs is its `WorkerSpec` (the phase's file, $TENPLEX_WORKER_SPEC or --spec) and the torchrun-style
environment (RANK, WORLD_SIZE, MASTER_*). A spec without a layout (torchrun) has the layout chosen for
WORLD_SIZE, or the one `tenplex layout` asked for (under agents) where it fits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, replace

import torch.distributed as dist

from ..ptc import PTCError, preset
from ..ptc.layout import Layout, parse_layout
from ..train.config import TrainConfig
from ..train.trainer import Trainer
from ..util import env
from .job import ElasticJob, JobError
from .spec import SPEC, SpecError, WorkerSpec


def asked_layout(model: str, world: int, global_batch: int) -> Layout | None:
    """The layout `tenplex layout` asked for ($TENPLEX_LAYOUT), if this world, the model and the global
    batch fit it (else the world's own choice, said once by rank 0)."""
    text = env.get(env.LAYOUT)
    if text is None:
        return None
    layout = Layout.from_dict(parse_layout(text))
    try:
        layout.check(preset(model), world)
        if global_batch % layout.dp:
            raise PTCError(f"dp={layout.dp} does not divide the global batch of {global_batch}")
    except PTCError as e:
        if os.environ.get("RANK") == "0":
            print(f"[tenplex] layout {text} not taken: {e}", flush=True)
        return None
    return layout


def run(spec: WorkerSpec) -> int:
    if spec.train is None:
        raise SpecError("the reference workload's spec has no training config")
    cfg = TrainConfig(**spec.train)
    layout = spec.layout or asked_layout(cfg.model, int(os.environ["WORLD_SIZE"]), cfg.global_batch)
    if layout is None:
        from .chooser import choose

        layout = choose(cfg.model, int(os.environ["WORLD_SIZE"]), cfg.global_batch, table=spec.table)
    layout = replace(layout, fsdp=layout.fsdp or cfg.fsdp)  # --fsdp under torchrun: the chooser's dp, sharded
    cfg.dp, cfg.tp, cfg.pp, cfg.fsdp = layout.dp, layout.tp, layout.pp, layout.fsdp
    job = ElasticJob(spec=replace(spec, layout=layout), device=cfg.device)
    trainer = Trainer(cfg)
    if job.ahead:
        # a rehearsal while the old layout trains: this layout's first step pays DTensor's caches for its
        # mesh, the pipeline's buffers and the first collectives now, not after the change. The load
        # below overwrites everything it changed (parameters, optimizer moments and step, LR schedule,
        # sampler position, RNG state, step); nothing of it is recorded
        trainer.train_step()
        if not job.wait_turn():  # the old layout ended otherwise: this one never runs
            dist.destroy_process_group()
            return 0
    fresh_optimizer = not trainer.optimizer.state
    state = trainer.state_dict()  # a fresh optimizer gets its state (`train.optim.init_state`)
    job.resume(state)
    if job.resumed:
        trainer.load_state_dict(state)
    elif job.ahead:  # the rehearsed step would stay in the model: never train on from it
        raise JobError("a phase started ahead found no snapshot to start from")
    elif fresh_optimizer:  # as `tenplex train` starts: AdamW's first step is step 1, not 2
        trainer.optimizer.state.clear()
    job.ready(trainer.step, sampler=trainer.sampler.state_dict())
    ledger = trainer.pp_rank == 0 and trainer.tp_rank == 0  # one writer per dp rank
    pace = spec.min_step_seconds
    while job.running(trainer.step):
        ids = trainer.sampler.rank_ids(cfg.dp, trainer.dp_rank).tolist() if ledger else None
        t_step = time.perf_counter()
        m = trainer.train_step()
        if pace:
            time.sleep(max(0.0, pace - (time.perf_counter() - t_step)))
        if ledger:
            job.samples(m.step, trainer.dp_rank, ids)
        fields = asdict(m)
        job.step_done(fields.pop("step"), trainer.state_dict, tokens_per_s=m.tokens_per_s, **fields)
    job.finish(trainer.state_dict, trainer.step)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of the reference workload in a tenplex elastic job")
    p.add_argument("--spec", help=f"path of the worker spec (default: ${SPEC})")
    args = p.parse_args(argv)
    try:
        spec = WorkerSpec.from_file(args.spec).placed() if args.spec else WorkerSpec.from_env()
    except SpecError as e:
        print(f"tenplex rank: {e}", file=sys.stderr)
        return 2
    if spec is None:
        print(f"tenplex rank: no spec (--spec or ${SPEC})", file=sys.stderr)
        return 2
    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
