"""A Hugging Face `LlamaForCausalLM` (or `Qwen2ForCausalLM`) from a tiny config, FSDP2 over its decoder
layers, elastic under tenplex: scale-out, a killed rank, scale-in.

    tenplex run --script examples/hf_llama.py --schedule examples/hf_schedule.yaml --steps 12

Nothing is downloaded: the model is built from its config and trained on tenplex's byte-level corpus.
Needs `pip install tenplex[hf]` (see docs/integrations.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import tenplex
from tenplex.data import ElasticSampler, TokenWindows, build_corpus
from tenplex.integrations import TrainState
from tenplex.integrations.hf import shard, tiny_causal_lm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="hf-llama")
    p.add_argument("--family", default="llama", choices=["llama", "qwen2"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--snapshot-every", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    job = tenplex.ElasticJob(args.job, until=args.steps, snapshot_every=args.snapshot_every, out=args.out)
    if job.rank == 0:
        build_corpus()
    dist.barrier()
    windows = TokenWindows(build_corpus().tokens("train"), args.seq)
    sampler = ElasticSampler(len(windows), args.global_batch, seed=0)

    model = shard(tiny_causal_lm(args.family, seq=args.seq), init_device_mesh("cpu", (job.world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = TrainState(model, opt, sampler=sampler)

    step = job.resume(state)  # loaded and restored; a fresh start leaves the optimizer fresh
    job.ready(step, layout=f"fsdp{job.world}", sampler=sampler.state_dict())

    while job.running(step):
        ids = sampler.rank_ids(job.world, job.rank)
        batch = torch.from_numpy(windows.get(ids)).long()
        out = model(input_ids=batch[:, :-1]).logits
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()  # FSDP2 averages the ranks' gradients
        opt.step()
        opt.zero_grad()
        sampler.advance()
        step += 1
        job.samples(step, job.rank, ids.tolist())
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        job.step_done(step, state, loss=mean.item() / job.world)
    job.finish(state, step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
