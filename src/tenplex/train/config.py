"""The training job's configuration and its command-line flags; torch-free so the CLI loads fast."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..data.sampler import ElasticSampler, split_bounds
from ..ptc import PTC, GPTConfig, gpt_ptc, preset
from ..ptc.layout import Layout, LayoutError


@dataclass
class TrainConfig:
    """Everything a rank needs; plain values so it pickles to spawned ranks and prints as JSON."""

    model: str = "tiny"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    steps: int = 50
    global_batch: int = 8
    micro_batch: int = 0  # 0: auto (one per rank, or pp micro-batches per rank with pipelining)
    seed: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    total_steps: int = 0  # horizon of the cosine schedule; 0: steps
    weight_decay: float = 0.1
    clip: float = 1.0
    pp_schedule: str = "1f1b"  # pipelining schedule: gpipe or 1f1b
    corpus: str | None = None  # a built corpus directory; None: build from `sources`
    sources: list[str] = field(default_factory=list)  # files/dirs; empty: the stdlib
    split: str = "train"
    eval_every: int = 0  # held-out loss every this many steps (0: never)
    eval_batches: int = 4  # global batches of the held-out split per evaluation
    metrics: str | None = None  # JSON-lines path, written by rank 0
    device: str = "auto"  # auto, cpu or cuda

    @property
    def layout(self) -> Layout:
        return Layout(self.dp, self.tp, self.pp, self.fsdp)

    def gpt(self) -> GPTConfig:
        return preset(self.model)

    def state_ptc(self, layout: Layout, devices: Sequence[tuple[str, str]]) -> PTC:
        """This job's state laid out as `layout` on (device id, host) pairs in rank order, symbolically: the
        names and placements of the real state, which the runtime places ranks by."""
        zero = 3 if layout.fsdp else 0
        return gpt_ptc(self.gpt(), layout.dp, layout.tp, layout.pp, devices=devices, zero=zero)

    def check_batching(self, sampler: ElasticSampler) -> int:
        """Micro-batches per rank and step; a one-line error for a batch this layout cannot take.

        Pipelining needs micro-batches of one size within a pipeline (the stages' buffers are shaped once).
        """
        n_micro = sampler.micro_batches_per_rank(self.dp, self.micro_batch_size())
        if self.pp > 1:
            for r in range(self.dp):
                start, stop = split_bounds(self.global_batch, self.dp, r)
                if (stop - start) % n_micro:
                    raise LayoutError(
                        f"pipelining needs equal micro-batches: dp rank {r}'s {stop - start} samples do not "
                        f"split into {n_micro}; choose a global batch and micro-batch that divide evenly"
                    )
        return n_micro

    def micro_batch_size(self) -> int:
        """The configured micro-batch, or auto: one per rank, pp of them per rank with pipelining."""
        part = -(-self.global_batch // self.dp)
        return self.micro_batch or -(-part // self.pp)


class Renamed(argparse.Action):
    """A flag's old spelling, refused with a pointer to its new name (exit 2): `--schedule` is the resource
    schedule of `tenplex run`, so the pipeline schedule of `train` is `--pp-schedule`."""

    def __init__(self, option_strings: list[str], dest: str, renamed_to: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.renamed_to = renamed_to

    def __call__(
        self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, opt: Any = None
    ) -> None:
        parser.error(f"{opt} is now {self.renamed_to} (--schedule is the resource schedule of `tenplex run`)")


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The flags of `tenplex train` and of `python -m tenplex.train.trainer` (one definition for both)."""
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="preset name (tiny, small, base, medium, gpt3-...)")
    for name in ("dp", "tp", "pp"):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{name} size")
    p.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state over dp (FSDP2)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps to train")
    p.add_argument("--global-batch", type=int, default=d.global_batch, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="samples per micro-batch (0: auto)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the weights and the sample order")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument(
        "--warmup", type=int, default=d.warmup, help="linear warm-up steps before the cosine decay"
    )
    p.add_argument("--total-steps", type=int, default=d.total_steps, help="cosine horizon (0: --steps)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW's, on matrices only")
    p.add_argument("--clip", type=float, default=d.clip, help="gradient-norm clip (0: off)")
    p.add_argument("--pp-schedule", choices=("gpipe", "1f1b"), default=d.pp_schedule,
                   help="the pipeline schedule of the micro-batches (with --pp above 1)")  # fmt: skip
    p.add_argument(
        "--schedule", nargs="?", action=Renamed, renamed_to="--pp-schedule", help=argparse.SUPPRESS
    )
    p.add_argument("--corpus", default=None, help="a built corpus directory")
    p.add_argument("--source", dest="sources", action="append", default=[], help="text file/dir (repeat)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out loss every N steps")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="global batches per evaluation")
    p.add_argument("--metrics", default=None, help="JSON-lines output, one object per step")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device,
                   help="auto: a GPU per local rank when there are enough, else the CPU")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = set(TrainConfig.__dataclass_fields__)
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names})
