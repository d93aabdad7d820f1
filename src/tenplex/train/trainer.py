"""The per-rank training loop: `Trainer(cfg)` in every rank of an initialised process group.

Use it three ways: `tenplex train` (spawns local ranks through `launch.py`), `torchrun --nproc-per-node N -m
tenplex.train.trainer --dp .. --tp .. --pp ..`, or programmatically: call `run_worker(TrainConfig(...))` in
every rank (it initialises the default group from the torchrun environment variables when needed), or
build a `Trainer` and drive `train_step()`, `state_dict()` and `load_state_dict()` yourself (as the
runtime does).

Loss arithmetic: every micro-batch's loss is the *sum* of its token losses divided by the token count of
the whole global batch, gradients are summed over micro-batches and over dp (all-reduce or FSDP
reduce-scatter with divide factor 1), so the gradient is the global-batch mean whatever the layout and
however unevenly the global batch splits over dp.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data import Corpus, CorpusError, ElasticSampler, TokenWindows, build_corpus, split_bounds
from ..ptc.layout import LayoutError
from ..transformer.world import init_distributed, use_cuda
from .config import TrainConfig, add_train_args, config_from_args
from .metrics import MetricsWriter, StepMetrics
from .optim import build_optimizer, build_scheduler
from .parallel import allreduce_grads, build_mesh, build_model, coords, scale_grads
from .parallel import sq_norm_share as _sq_norm_share
from .state import job_state, load_job_state


def _device(kind: str) -> torch.device:
    if use_cuda(kind):
        idx = int(os.environ.get("LOCAL_RANK", dist.get_rank() % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(idx)
        return torch.device("cuda", idx)
    return torch.device("cpu")


def open_corpus(cfg: TrainConfig) -> Corpus:
    """The configured corpus; when it must be built, rank 0 builds and the others then hit the cache."""
    if cfg.corpus:
        return Corpus(Path(cfg.corpus))
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return build_corpus(cfg.sources or None)
    corpus = build_corpus(cfg.sources or None)
    if dist.is_initialized():
        dist.barrier()
    return corpus


class Trainer:
    """One rank of a (dp, tp, pp) GPT job: model stage, optimizer, LR schedule, sampler, step."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus | None = None) -> None:
        self.cfg, self.gpt, self.layout = cfg, cfg.gpt(), cfg.layout
        self.layout.check(self.gpt, dist.get_world_size())
        if cfg.pp_schedule not in ("gpipe", "1f1b"):
            raise LayoutError(f"unknown pipeline schedule {cfg.pp_schedule!r} (gpipe or 1f1b)")
        self.device = _device(cfg.device)
        self.mesh = build_mesh(self.layout, self.device.type)
        self.pp_rank, self.dp_rank, self.tp_rank = coords(self.mesh)
        self.model = build_model(self.gpt, self.layout, self.mesh, cfg.seed, self.device)
        self.optimizer = build_optimizer(self.model, cfg.lr, cfg.weight_decay)
        self.scheduler = build_scheduler(
            self.optimizer, cfg.warmup, cfg.total_steps or cfg.steps, cfg.min_lr_ratio
        )
        self.corpus = corpus or open_corpus(cfg)
        self.windows = TokenWindows(self.corpus.tokens(cfg.split), self.gpt.seq)
        self.val_windows: TokenWindows | None = None
        self.sampler = ElasticSampler(len(self.windows), cfg.global_batch, cfg.seed)
        self.micro_batch = cfg.micro_batch_size()
        self.n_micro = cfg.check_batching(self.sampler)
        self.tokens_per_batch = cfg.global_batch * self.gpt.seq
        self.step = 0
        self.pipeline = self._pipeline() if self.layout.pp > 1 else None

    # -- pieces ------------------------------------------------------------------------------------------
    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token losses over the global batch's token count: partial sums add up to the mean."""
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum"
        )
        return ce / self.tokens_per_batch

    def _pipeline(self) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        inputs, outputs = self._stage_shapes()
        stage = PipelineStage(
            self.model, self.pp_rank, self.layout.pp, self.device, inputs, outputs,
            group=self.mesh["pp"].get_group(),
        )  # fmt: skip
        kind = Schedule1F1B if self.cfg.pp_schedule == "1f1b" else ScheduleGPipe
        return kind(stage, n_microbatches=self.n_micro, loss_fn=self.loss_fn, scale_grads=False)

    def _stage_shapes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's micro-batch input and output, as meta tensors: given up front, the stages skip the
        shape exchange of their first step (part of a new pp layout's first step after a change). Every
        micro-batch of a pipeline has one size (`check_batching`), training and evaluation alike; the
        stages' outputs are plain tensors (the tensor-parallel plan gathers the logits)."""
        start, stop = split_bounds(self.cfg.global_batch, self.layout.dp, self.dp_rank)
        mb, seq, hidden = (stop - start) // self.n_micro, self.gpt.seq, self.gpt.hidden
        dtype = next(self.model.parameters()).dtype
        first, last = self.pp_rank == 0, self.pp_rank == self.layout.pp - 1
        if first:
            x = torch.empty(mb, seq, dtype=torch.long, device="meta")
        else:  # the gradient of a received activation goes back to the stage before
            x = torch.empty(mb, seq, hidden, dtype=dtype, device="meta", requires_grad=True)
        out = (mb, seq, self.gpt.vocab) if last else (mb, seq, hidden)
        return x, torch.empty(out, dtype=dtype, device="meta", requires_grad=True)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.concatenate(self.sampler.micro_batch_ids(self.layout.dp, self.dp_rank, self.micro_batch))
        return self._tensors(self.windows, ids)

    def _tensors(self, windows: TokenWindows, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(windows.get(ids)).to(self.device)
        return batch[:, :-1], batch[:, 1:]

    def _forward(self, x: torch.Tensor, y: torch.Tensor, backward: bool = True) -> torch.Tensor:
        """This rank's summed loss share (zero where the rank does not compute the loss)."""
        loss = torch.zeros((), device=self.device)
        if self.pipeline is None:
            for k, (xs, ys) in enumerate(zip(x.tensor_split(self.n_micro), y.tensor_split(self.n_micro))):
                if self.layout.fsdp and backward:
                    self.model.set_requires_gradient_sync(k == self.n_micro - 1)
                with torch.set_grad_enabled(backward):
                    micro = self.loss_fn(self.model(xs), ys)
                if backward:
                    micro.backward()
                loss += micro.detach()
            return loss
        run = self.pipeline.step if backward else self.pipeline.eval
        if self.pp_rank == 0:
            run(x)
        elif self.pp_rank == self.layout.pp - 1:
            losses: list[torch.Tensor] = []
            run(target=y, losses=losses)
            loss = torch.stack([t.detach() for t in losses]).sum()
        else:
            run()
        return loss

    def _global_loss(self, loss: torch.Tensor, extra: torch.Tensor | None = None) -> list[float]:
        """[global mean loss, *extra summed over the job]: one all-reduce of a few float64 scalars."""
        owns_loss = self.pp_rank == self.layout.pp - 1 and self.tp_rank == 0
        parts = [loss.double().cpu() * owns_loss]
        if extra is not None:
            parts.append(extra)
        shares = torch.stack(parts).to(self.device)
        dist.all_reduce(shares)
        return shares.tolist()

    @torch.no_grad()
    def evaluate(self, batches: int = 4) -> float:
        """Mean loss on the held-out split over its first `batches` global batches (a fixed, unshuffled
        order, so every layout and every step evaluates the same tokens)."""
        if self.val_windows is None:
            self.val_windows = TokenWindows(self.corpus.tokens("val"), self.gpt.seq)
        gb, dp = self.cfg.global_batch, self.layout.dp
        batches = min(batches, len(self.val_windows) // gb)
        if batches < 1:
            raise CorpusError(f"the held-out split has fewer than {gb} samples of {self.gpt.seq + 1} tokens")
        self.model.eval()
        total = 0.0
        try:
            for b in range(batches):
                start, stop = split_bounds(gb, dp, self.dp_rank)
                x, y = self._tensors(self.val_windows, np.arange(b * gb + start, b * gb + stop))
                total += self._global_loss(self._forward(x, y, backward=False))[0]
        finally:
            self.model.train()
        return total / batches

    # -- the step ------------------------------------------------------------------------------------------
    def train_step(self) -> StepMetrics:
        t0 = time.perf_counter()
        x, y = self._batch()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward(x, y)
        if not self.layout.fsdp and self.layout.dp > 1:
            allreduce_grads(self.model, self.mesh["dp"].get_group())
        global_loss, sq_norm = self._global_loss(loss, _sq_norm_share(self.model, self.layout))
        norm = sq_norm**0.5
        if self.cfg.clip > 0 and norm > self.cfg.clip:
            scale_grads(self.model, self.cfg.clip / (norm + 1e-6))
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.sampler.advance()
        self.step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return StepMetrics(
            self.step,
            global_loss,
            lr,
            norm,
            self.tokens_per_batch,
            time.perf_counter() - t0,
            str(self.layout),
        )

    def state_dict(self) -> dict[str, Any]:
        return job_state(self.model, self.optimizer, self.scheduler, self.sampler, self.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = load_job_state(self.model, self.optimizer, self.scheduler, self.sampler, state)


def run_worker(cfg: TrainConfig, on_step: Callable[[StepMetrics], None] | None = None) -> list[StepMetrics]:
    """Train `cfg.steps` steps in this rank; rank 0 writes `cfg.metrics` and calls `on_step`."""
    init_distributed(cfg.device)
    trainer = Trainer(cfg)
    writer = MetricsWriter(cfg.metrics) if cfg.metrics and dist.get_rank() == 0 else None
    out = []
    try:
        while trainer.step < cfg.steps:
            m = trainer.train_step()
            if cfg.eval_every and m.step % cfg.eval_every == 0:
                m.val_loss = trainer.evaluate(cfg.eval_batches)
            out.append(m)
            if dist.get_rank() == 0:
                if writer:
                    writer.write(m)
                if on_step:
                    on_step(m)
    finally:
        if writer:
            writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: `torchrun --nproc-per-node 4 -m tenplex.train.trainer --dp 2 --tp 2`."""
    p = argparse.ArgumentParser(prog="python -m tenplex.train.trainer")
    add_train_args(p)
    cfg = config_from_args(p.parse_args(argv))

    def show(m: StepMetrics) -> None:
        print(m.to_json(), flush=True)

    run_worker(cfg, on_step=show)
    # every rank past its last send first: a gloo send still in flight when a peer tears its group down
    # aborts the process ("terminate called without an active exception", once in CI with pp=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
