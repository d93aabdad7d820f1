"""Run several layouts one after another in one spawned process group (tests and the benchmark).

Spawning ranks and importing torch cost far more than training the tiny model, so one group per world size
runs every layout of that size; each case builds its own mesh, model and sampler from the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch.distributed as dist

from ..data import Corpus
from .state import full_model_state
from .trainer import TrainConfig, Trainer


@dataclass
class Case:
    cfg: TrainConfig
    record_params: bool = False  # return the gathered global parameters after the last step
    save_at: int = 0  # DCP-save the job state after this step into `checkpoint` (0: never)
    load: bool = False  # DCP-load the job state from `checkpoint` before training
    checkpoint: str = ""
    evaluate: int = 0  # held-out loss over this many global batches after the last step (0: skip)


@dataclass
class CaseResult:
    layout: str
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    val_loss: float | None = None
    params: dict[str, np.ndarray] = field(default_factory=dict)  # this rank's stage, if dp=tp=0 here


def run_case(case: Case, corpus: Corpus) -> CaseResult:
    import torch.distributed.checkpoint as dcp

    trainer = Trainer(case.cfg, corpus)
    if case.load:
        sd = trainer.state_dict()
        dcp.load(sd, checkpoint_id=case.checkpoint)
        trainer.load_state_dict(sd)
    res = CaseResult(str(trainer.layout), tokens_per_step=trainer.tokens_per_batch)
    while trainer.step < case.cfg.steps:
        m = trainer.train_step()
        res.steps.append(m.step)
        res.losses.append(m.loss)
        res.grad_norms.append(m.grad_norm)
        res.step_times.append(m.step_time)
        if case.save_at and m.step == case.save_at:
            dcp.save(trainer.state_dict(), checkpoint_id=case.checkpoint)
    if case.evaluate:
        res.val_loss = trainer.evaluate(case.evaluate)
    if case.record_params:
        full = full_model_state(trainer.model)
        if trainer.dp_rank == 0 and trainer.tp_rank == 0:
            res.params = {k: v.numpy() for k, v in full.items()}
    dist.barrier()
    return res


def run_cases(cases: list[Case], corpus_path: str) -> list[CaseResult]:
    """Spawned-rank entry: every case in order; returns this rank's results."""
    corpus = Corpus(Path(corpus_path))
    return [run_case(case, corpus) for case in cases]
