"""examples/deepspeed_charlm.py's model, data and engine without tenplex, on one rank (ZeRO-1, as the
static run under `tenplex run`): the losses `tests/test_deepspeed.py` holds that run to, bit for bit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

from launch import write_result
from tenplex.data import ElasticSampler, TokenWindows, build_corpus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from deepspeed_charlm import CONTEXT, engine_for  # the example (examples/ is no package)


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    steps, global_batch = int(os.environ["DS_STEPS"]), 12
    windows = TokenWindows(build_corpus().tokens("train"), CONTEXT)
    sampler = ElasticSampler(len(windows), global_batch, seed=0)
    engine = engine_for(1, 1, global_batch, 3e-3)
    losses = {}
    for step in range(1, steps + 1):
        batch = torch.from_numpy(windows.get(sampler.rank_ids(1, 0)))
        loss = nn.functional.cross_entropy(engine(batch[:, :CONTEXT]), batch[:, CONTEXT])
        engine.backward(loss)
        engine.step()
        sampler.advance()
        losses[step] = loss.item()
    write_result(losses)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
