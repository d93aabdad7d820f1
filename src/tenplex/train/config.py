"""The training job's configuration and its command-line flags; torch-free so the CLI loads fast."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..data.sampler import ElasticSampler, split_bounds
from ..ptc import PTC, GPTConfig, gpt_ptc, preset
from ..ptc.layout import Layout, LayoutError
from ..util.flags import add_flags, flag, from_args


@dataclass
class TrainConfig:
    """Everything a rank needs; plain values so it pickles to spawned ranks and prints as JSON. The flags of
    `tenplex train` (and the training flags of `tenplex run`) are derived from these fields."""

    model: str = flag("tiny", "GPT preset (tiny, small, base, medium, gpt3-...)")
    dp: int = flag(1, "dp size: data-parallel replicas")
    tp: int = flag(1, "tp size: tensor-parallel ranks per layer")
    pp: int = flag(1, "pp size: pipeline stages")
    fsdp: bool = flag(False, "shard parameters and optimizer state over dp (FSDP2)")
    steps: int = flag(50, "optimizer steps to train")
    global_batch: int = flag(8, "samples per optimizer step, split over dp")
    micro_batch: int = flag(
        0, "samples per micro-batch (0: a rank's share of the global batch, in pp parts with pipelining)"
    )
    seed: int = flag(0, "seeds the weights, the sample order and dropout")
    lr: float = flag(1e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = 0.1
    warmup: int = flag(10, "linear warm-up steps before the cosine decay")
    total_steps: int = flag(0, "cosine horizon (0: --steps)")
    weight_decay: float = flag(0.1, "AdamW's, on matrices only")
    clip: float = flag(1.0, "gradient-norm clip (0: off)")
    pp_schedule: str = flag(
        "1f1b", "the pipeline schedule of the micro-batches (with --pp above 1)", choices=("gpipe", "1f1b")
    )
    corpus: str | None = flag(None, "a built corpus directory (default: build one from --source)")
    sources: list[str] = flag(
        help="text file/dir (repeat; default: the Python standard library's source)",
        names=("--source",),
        action="append",
        metavar="PATH",
        default_factory=list,
    )
    split: str = "train"
    eval_every: int = flag(0, "held-out loss every N steps (0: never)")
    eval_batches: int = flag(4, "global batches of the held-out split per evaluation")
    metrics: str | None = flag(None, "JSON-lines output, one object per step (written by rank 0)")
    device: str = flag(
        "auto",
        "auto: a GPU per local rank when there are enough, else the CPU",
        choices=("auto", "cpu", "cuda"),
    )

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


def add_train_args(p: argparse.ArgumentParser, defaults: dict[str, Any] | None = None, **which: Any) -> None:
    """The flags of `tenplex train` and of `python -m tenplex.train.trainer` (`which`: `only=`/`exclude=`
    fields; `defaults`: another workload's values, see `runtime.runconfig.REFERENCE`)."""
    add_flags(p, TrainConfig, defaults=defaults, **which)
    if "only" not in which:
        p.add_argument(
            "--schedule", nargs="?", action=Renamed, renamed_to="--pp-schedule", help=argparse.SUPPRESS
        )


def config_from_args(args: argparse.Namespace, **given: Any) -> TrainConfig:
    return from_args(TrainConfig, args, **given)
