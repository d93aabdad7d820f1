"""A DeepSpeed ZeRO training script, elastic: the character-level language model of elastic_charlm.py under
a DeepSpeed engine (ZeRO stage 2 by default, another per world size with --stages), AdamW and DeepSpeed's
WarmupLR, the exactly-once elastic sampler. The world size is the data-parallel size.

    tenplex run --script "examples/deepspeed_charlm.py --stages 3:3,1:1" \\
        --schedule examples/deepspeed_schedule.yaml --steps 10

On a machine without a GPU DeepSpeed runs on its CPU accelerator over gloo, in fp32. Alone or under
torchrun the flags below name the job and where records go, as in elastic_charlm.py.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import tenplex
from tenplex.data import ElasticSampler, TokenWindows, build_corpus
from tenplex.integrations.deepspeed import DeepSpeedState, zero_stage

CONTEXT = 16  # characters seen before the one to predict


def engine_for(world: int, stage: int, global_batch: int, lr: float) -> deepspeed.DeepSpeedEngine:
    torch.manual_seed(0)  # the same full model on every rank and in every layout; ZeRO keeps its part
    model = nn.Sequential(
        nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 256), nn.GELU(), nn.Linear(256, 256)
    )
    config = {
        "train_batch_size": global_batch,  # fixed: each of the `world` ranks takes its share
        "train_micro_batch_size_per_gpu": global_batch // world,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # a plain torch.optim.AdamW
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": lr}},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="ds-charlm")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--stage", type=int, default=2, help="the ZeRO stage (0-3)")
    p.add_argument("--stages", default="", help="another stage per world size: WORLD:STAGE,... (3:3,1:1)")
    p.add_argument("--snapshot-every", type=int, default=2)
    p.add_argument("--out", default=None, help="where records go (tenplex run sets its own)")
    args = p.parse_args()

    job = tenplex.ElasticJob(args.job, until=args.steps, snapshot_every=args.snapshot_every, out=args.out)
    deepspeed.init_distributed(dist_backend="gloo")  # takes the group ElasticJob made
    if job.rank == 0:
        build_corpus()  # the default corpus (the Python standard library's sources), cached after the first
    dist.barrier()
    windows = TokenWindows(build_corpus().tokens("train"), CONTEXT)
    sampler = ElasticSampler(len(windows), args.global_batch, seed=0)

    stage = zero_stage(job.world, args.stages, args.stage)
    engine = engine_for(job.world, stage, args.global_batch, args.lr)
    # ZeRO's partitions of the master weights and Adam moments, the scheduler, the counters, the sampler
    state = DeepSpeedState(engine, sampler=sampler)
    step = job.resume(state)  # from whatever dp size and stage wrote it
    job.ready(step, layout=f"zero{stage}-dp{job.world}", sampler=sampler.state_dict())

    while job.running(step):
        ids = sampler.rank_ids(job.world, job.rank)  # this rank's part of the fixed global batch
        batch = torch.from_numpy(windows.get(ids))
        loss = nn.functional.cross_entropy(engine(batch[:, :CONTEXT]), batch[:, CONTEXT])
        engine.backward(loss)  # DeepSpeed averages the gradients over the ranks: the global batch's mean
        engine.step()
        sampler.advance()
        step += 1
        job.samples(step, job.rank, ids.tolist())
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        job.step_done(step, state, loss=mean.item() / job.world)
    job.finish(state, step)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
