"""`tenplex train`: the reference GPT job in dp*tp*pp local ranks, with a progress bar and JSON-lines metrics.

The same flags work under torchrun: `torchrun --nproc-per-node N -m tenplex.train.trainer ...`.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    from ..train.config import add_train_args  # torch-free: torch loads only when the command runs

    p = sub.add_parser(
        "train",
        help="train the reference GPT with tensor, pipeline and data parallelism on local ranks",
        description="Spawn dp*tp*pp local ranks (gloo on CPU, NCCL on CUDA) and train the reference GPT on "
        "the Python standard library's source (or --source files), fed by the elastic, exactly-once sampler.",
    )
    add_train_args(p)
    p.add_argument("--no-progress", action="store_true", help="print one line per step instead of a bar")
    p.set_defaults(func=run)


def _validate(cfg: Any) -> None:
    """Catch user errors here, as one line, before spawning ranks."""
    from pathlib import Path

    from ..data import Corpus, ElasticSampler, TokenWindows

    cfg.layout.check(cfg.gpt())
    windows = TokenWindows(Corpus(Path(cfg.corpus)).tokens(cfg.split), cfg.gpt().seq)
    sampler = ElasticSampler(len(windows), cfg.global_batch, cfg.seed)
    cfg.check_batching(sampler)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..data import build_corpus
    from ..train.config import config_from_args
    from ..train.launch import train_locally

    cfg = config_from_args(args)
    console = Console(stderr=True)
    if not cfg.corpus:
        with console.status("building the corpus"):
            cfg.corpus = str(build_corpus(cfg.sources or None).path)
    _validate(cfg)
    console.print(f"training {cfg.model} as {cfg.layout} on {cfg.layout.world} local ranks")
    if args.no_progress:
        metrics = train_locally(cfg, on_step=lambda m: print(m.to_json(), flush=True))
    else:
        columns = (
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tokens/s"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as bar:
            task = bar.add_task("train", total=cfg.steps, loss=float("nan"), tps=0.0)
            metrics = train_locally(
                cfg, on_step=lambda m: bar.update(task, completed=m.step, loss=m.loss, tps=m.tokens_per_s)
            )
    if metrics:
        steady = metrics[1:] or metrics
        tps = sum(m.tokens for m in steady) / sum(m.step_time for m in steady)
        console.print(f"done: {len(metrics)} steps, final loss {metrics[-1].loss:.4f}, {tps:,.0f} tokens/s")
        evals = [m for m in metrics if m.val_loss is not None]
        if evals:
            console.print(f"held-out loss at step {evals[-1].step}: {evals[-1].val_loss:.4f}")
    if cfg.metrics:
        console.print(f"metrics: {cfg.metrics}")
    return 0
