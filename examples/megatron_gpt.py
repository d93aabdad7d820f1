"""A Megatron-core GPTModel (its own tensor-parallel layers, process groups and pipeline schedules), elastic
under tenplex: the tensor-, pipeline- and data-parallel sizes change at run time.

    tenplex run --script examples/megatron_gpt.py --schedule examples/megatron_schedule.yaml

`--tp 2:2,4:2 --pp 4:2` (the defaults): tp 2 on 2 ranks, tp 2 x pp 2 on 4; other world sizes are data
parallel. Every step runs Megatron's own forward-backward schedule over 2 micro-batches.
The model's state comes from its own `sharded_state_dict()` (`tenplex.integrations.megatron`), the AdamW
moments take their parameters' layouts. Megatron's own DDP wrapper and optimizer allocate on CUDA, so the
script sums the gradients over the data-parallel group itself and steps a `torch.optim.AdamW`. The model
trains on the CPU (gloo), with the tests' stand-ins for Megatron's CUDA-only spots (tests/megatron_cpu.py).
Needs `pip install tenplex[megatron]` (see docs/integrations.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

import tenplex
from tenplex.data import ElasticSampler, TokenWindows, build_corpus
from tenplex.integrations import layout_for
from tenplex.integrations.megatron_train import MegatronState, tiny_gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import megatron_cpu  # the stand-ins for Megatron's CUDA-only spots, each with its reason


def layout(world: int, tp_table: str, pp_table: str) -> tuple[int, int, int]:
    """(dp, tp, pp) for `world` ranks from the `--tp` and `--pp` tables."""
    _, tp = layout_for(world, tp_table)
    _, pp = layout_for(world, pp_table)
    if world % (tp * pp):
        raise tenplex.TenplexError(f"tp {tp} x pp {pp} does not divide the world of {world} ranks")
    return world // (tp * pp), tp, pp


def sum_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """The data-parallel ranks' gradients summed in one all-reduce (what Megatron's DDP does on GPUs)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def micro_step(seq: int, global_tokens: int, micro_batches: int, data: Iterator, model: torch.nn.Module):
    """One micro-batch forward, and its loss: this micro-batch's share of the global mean cross entropy
    (the schedule divides what the loss function returns by the number of micro-batches)."""
    batch = next(data)
    positions = torch.arange(seq).unsqueeze(0)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    out = model(batch[:, :-1], positions, causal, labels=batch[:, 1:])

    def loss(per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
        share = per_token.sum() / global_tokens
        return share * micro_batches, {"loss": share.item()}

    return out, loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", default="megatron-gpt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tp", default="2:2,4:2", help="WORLD:TP entries; other world sizes run tp 1")
    p.add_argument("--pp", default="4:2", help="WORLD:PP entries; other world sizes run pp 1")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--snapshot-every", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    job = tenplex.ElasticJob(args.job, until=args.steps, snapshot_every=args.snapshot_every, out=args.out)
    if job.rank == 0:
        build_corpus()
    dist.barrier()
    windows = TokenWindows(build_corpus().tokens("train"), args.seq)
    sampler = ElasticSampler(len(windows), args.global_batch, seed=0)

    dp, tp, pp = layout(job.world, args.tp, args.pp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    megatron_cpu.on_cpu()
    megatron_cpu.seed_all(0)
    model = tiny_gpt(tp, pp, hidden=64, heads=4, layers=2, vocab=256, seq=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    state = MegatronState(model, opt, sampler=sampler)

    step = job.resume(state)  # loaded in place; a fresh start leaves the optimizer fresh
    job.ready(step, layout=f"dp{dp}-tp{tp}-pp{pp}", sampler=sampler.state_dict())

    dp_rank, dp_group = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_group()
    first = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.is_pipeline_first_stage()
    micro = args.global_batch // dp // args.micro_batches
    train_step = partial(micro_step, args.seq, args.global_batch * args.seq, args.micro_batches)
    while job.running(step):
        ids = sampler.rank_ids(dp, dp_rank)
        batch = torch.from_numpy(windows.get(ids)).long()
        store = get_forward_backward_func()(
            forward_step_func=train_step,
            data_iterator=iter(batch.split(micro)),
            model=model,
            num_microbatches=args.micro_batches,
            seq_length=args.seq,
            micro_batch_size=micro,
        )
        sum_gradients(model, dp_group)
        opt.step()
        opt.zero_grad()
        sampler.advance()
        step += 1
        if first:
            job.samples(step, dp_rank, ids.tolist())
        # the last stage's tp ranks each hold their dp rank's share: summed over the world, divided by tp
        total = torch.tensor(float(sum(x["loss"] for x in store)))
        dist.all_reduce(total)
        job.step_done(step, state, loss=total.item() / tp)
    job.finish(state, step)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
