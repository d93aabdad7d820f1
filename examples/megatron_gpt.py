"""A Megatron-core GPTModel (its own tensor-parallel layers and process groups), elastic under tenplex: the
tensor-parallel and the data-parallel size change at run time.

    tenplex run --script "examples/megatron_gpt.py --tp 2:2" --schedule examples/megatron_schedule.yaml \
        --steps 10

`--tp 2:2` runs tensor parallelism 2 whenever the phase has 2 ranks; other world sizes are data parallel.
The model's state comes from its own `sharded_state_dict()` (`tenplex.integrations.megatron`), the AdamW
moments take their parameters' layouts. Megatron's own DDP wrapper and optimizer allocate on CUDA, so the
script sums the gradients over the data-parallel group itself and steps a `torch.optim.AdamW`. On a
machine without CUDA it applies the tests' stand-ins for Megatron's CUDA-only spots (tests/megatron_cpu.py).
Needs `pip install tenplex[megatron]` (see docs/integrations.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

import tenplex
from tenplex.data import ElasticSampler, TokenWindows, build_corpus
from tenplex.integrations import layout_for
from tenplex.integrations.megatron_train import MegatronState, tiny_gpt

if not torch.cuda.is_available():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import megatron_cpu  # the CPU stand-ins, each with its reason


def seed(value: int) -> None:
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(value)
        torch.manual_seed(value)
    else:
        megatron_cpu.on_cpu()
        megatron_cpu.seed_all(value)


def sum_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """The data-parallel ranks' gradients summed in one all-reduce (what Megatron's DDP does on GPUs)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="megatron-gpt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tp", default="2:2", help="WORLD:TP entries; other world sizes run tp 1")
    p.add_argument("--snapshot-every", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    job = tenplex.ElasticJob(args.job, until=args.steps, snapshot_every=args.snapshot_every, out=args.out)
    if job.rank == 0:
        build_corpus()
    dist.barrier()
    windows = TokenWindows(build_corpus().tokens("train"), args.seq)
    sampler = ElasticSampler(len(windows), args.global_batch, seed=0)

    dp, tp = layout_for(job.world, args.tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    seed(0)
    model = tiny_gpt(tp, hidden=64, heads=4, layers=2, vocab=256, seq=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = MegatronState(model, opt, sampler=sampler)

    step = job.resume(state)  # loaded in place; a fresh start leaves the optimizer fresh
    job.ready(step, layout=f"dp{dp}-tp{tp}", sampler=sampler.state_dict())

    dp_rank, dp_group = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_group()
    positions = torch.arange(args.seq).unsqueeze(0)
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), diagonal=1).view(1, 1, args.seq, -1)
    while job.running(step):
        ids = sampler.rank_ids(dp, dp_rank)
        batch = torch.from_numpy(windows.get(ids)).long()
        per_token = model(batch[:, :-1], positions, causal, labels=batch[:, 1:])
        loss = per_token.sum() / (args.global_batch * args.seq)  # this rank's share of the global mean
        loss.backward()
        sum_gradients(model, dp_group)
        opt.step()
        opt.zero_grad()
        sampler.advance()
        step += 1
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            job.samples(step, dp_rank, ids.tolist())
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        job.step_done(step, state, loss=total.item())
    job.finish(state, step)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
