"""torchtitan's Llama 3 (its own model code and `parallelize_llama`: FSDP2 + TP), elastic under tenplex.

    tenplex run --script "examples/titan_llama.py --tp 4:2" --schedule examples/titan_schedule.yaml --steps 16

`--tp 4:2` runs tensor parallelism 2 whenever the phase has 4 ranks (dp 2 x tp 2, `_StridedShard`
parameters); other world sizes are FSDP2 alone. The fixed global batch is split over the dp ranks; the
tp ranks of one dp rank see the same samples. Needs `pip install tenplex[titan]` (see docs/integrations.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import tenplex
from tenplex.data import ElasticSampler, TokenWindows, build_corpus
from tenplex.integrations import TrainState, layout_for
from tenplex.integrations.titan import TinyLlama, build_llama3, global_loss, parallelize


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="titan-llama")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tp", default="4:2", help="WORLD:TP entries; other world sizes run tp 1")
    p.add_argument("--snapshot-every", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    job = tenplex.ElasticJob(args.job, until=args.steps, snapshot_every=args.snapshot_every, out=args.out)
    if job.rank == 0:
        build_corpus()
    dist.barrier()
    windows = TokenWindows(build_corpus().tokens("train"), args.seq)
    sampler = ElasticSampler(len(windows), args.global_batch, seed=0)

    dp, tp = layout_for(job.world, args.tp)
    model = build_llama3(TinyLlama(max_seq_len=args.seq), seed=0)  # the same full model in every layout
    parallelize(model, job.world, tp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = TrainState(model, opt, sampler=sampler)

    step = job.resume(state)  # loaded and restored; a fresh start leaves the optimizer fresh
    job.ready(step, layout=f"dp{dp}-tp{tp}-fsdp", sampler=sampler.state_dict())

    dp_rank = job.rank // tp
    while job.running(step):
        ids = sampler.rank_ids(dp, dp_rank)
        batch = torch.from_numpy(windows.get(ids)).long()
        loss = global_loss(model(batch[:, :-1]), batch[:, 1:], args.global_batch * args.seq)
        loss.backward()  # FSDP2 sums the dp ranks' gradients (torchtitan's convention)
        opt.step()
        opt.zero_grad()
        sampler.advance()
        step += 1
        if job.rank % tp == 0:
            job.samples(step, dp_rank, ids.tolist())
        total = loss.detach().clone()
        dist.all_reduce(total)  # the dp ranks' shares, once per tp rank
        job.step_done(step, state, loss=total.item() / tp)
    job.finish(state, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
