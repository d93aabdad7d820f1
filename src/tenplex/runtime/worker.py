"""One rank of the reference workload as an elastic job (an `ElasticJob` script, plus the data ledger).

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

import torch.distributed as dist

from ..train.config import TrainConfig
from ..train.worker import Trainer
from .job import ElasticJob


def run(spec: dict[str, Any]) -> int:
    cfg = TrainConfig(**spec["train"])
    if spec.get("choose", False):
        from .chooser import choose

        best = choose(cfg.model, int(os.environ["WORLD_SIZE"]), cfg.global_batch, table=spec.get("table"))
        cfg.dp, cfg.tp, cfg.pp = best.dp, best.tp, best.pp
    job = ElasticJob(spec={**spec, "layout": asdict(cfg.layout)}, device=cfg.device)
    trainer = Trainer(cfg)
    state = trainer.state_dict()
    job.resume(state)
    if job.resumed:
        trainer.load_state_dict(state)
    job.ready(trainer.step, sampler=trainer.sampler.state_dict())
    ledger = trainer.pp_rank == 0 and trainer.tp_rank == 0  # one writer per dp rank
    pace = float(spec.get("min_step_seconds", 0))  # emulates slower devices (tests, demos)
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
