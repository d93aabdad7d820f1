"""Your own training script, elastic under tenplex: a character-level MLP language model on real text,
FSDP2 over every rank (the world size is the layout), AdamW, and the exactly-once elastic sampler.

    tenplex run --script examples/elastic_charlm.py --schedule examples/schedule.yaml --steps 30

Under `tenplex run` the runtime tells the job its name, the step to stop at, when to snapshot and where to
write records; alone or under torchrun the flags below do:

    torchrun --nproc-per-node 2 examples/elastic_charlm.py --job charlm --steps 30 --out runs/charlm
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tenplex
from tenplex.data import ElasticSampler, TokenWindows, build_corpus
from tenplex.integrations import TrainState

CONTEXT = 16  # characters seen before the one to predict


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="charlm")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--snapshot-every", type=int, default=5)
    p.add_argument("--out", default=None, help="where records go (tenplex run sets its own)")
    p.add_argument("--min-step-seconds", type=float, default=0.0, help="pace steps (emulates slower devices)")
    args = p.parse_args()

    job = tenplex.ElasticJob(args.job, until=args.steps, snapshot_every=args.snapshot_every, out=args.out)
    if job.rank == 0:
        build_corpus()  # the default corpus (the Python standard library's sources), cached after the first
    dist.barrier()
    windows = TokenWindows(build_corpus().tokens("train"), CONTEXT)
    sampler = ElasticSampler(len(windows), args.global_batch, seed=0)

    torch.manual_seed(0)  # the same full model on every rank and in every layout; FSDP2 keeps a slice
    model = nn.Sequential(
        nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 256), nn.GELU(), nn.Linear(256, 256)
    )
    fully_shard(model, mesh=init_device_mesh("cpu", (job.world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # model and optimizer through DCP's state-dict API (the same names in every layout), plus the sampler
    state = TrainState(model, opt, sampler=sampler)
    step = job.resume(state)  # in place, from whatever layout wrote it; a fresh start keeps `opt` fresh
    job.ready(step, layout=f"fsdp{job.world}", sampler=sampler.state_dict())  # how the run names it

    while job.running(step):
        started = time.perf_counter()
        ids = sampler.rank_ids(job.world, job.rank)  # this rank's part of the fixed global batch
        batch = torch.from_numpy(windows.get(ids))
        loss = nn.functional.cross_entropy(model(batch[:, :CONTEXT]), batch[:, CONTEXT])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sampler.advance()
        step += 1
        job.samples(step, job.rank, ids.tolist())
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        time.sleep(max(0.0, args.min_step_seconds - (time.perf_counter() - started)))
        job.step_done(step, state, loss=mean.item() / job.world)
    job.finish(state, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
