"""Control values every rank of a job agrees on, over the default process group: a stop, a count, the
ranks' start times. Small tensors, moved where the group's backend can reduce them."""

from __future__ import annotations

import torch
import torch.distributed as dist


def on_backend(t: torch.Tensor) -> torch.Tensor:
    """Control values go where the default group's backend can reduce them (NCCL: this rank's GPU)."""
    return t.cuda() if dist.get_backend() == "nccl" else t


def any_rank(flag: bool) -> bool:
    """Whether any rank says so: every rank gets the same answer."""
    t = on_backend(torch.tensor([1.0 if flag else 0.0]))
    dist.all_reduce(t)
    return bool(t.item())


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    keys = sorted(values)
    t = on_backend(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def from_every_rank(*values: float) -> list[list[float]]:
    """`values` of every rank, in rank order (float64: exact for times and PIDs)."""
    mine = on_backend(torch.tensor(values, dtype=torch.float64))
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]
