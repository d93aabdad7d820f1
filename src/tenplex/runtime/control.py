"""Control values every rank of a job agrees on, over the default process group: a stop, a count, the
ranks' start times. Small tensors, moved where the group's backend can reduce them."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import rounds
from .channel import RankChannel
from .spec import WorkerSpec


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


def rank_channel(spec: WorkerSpec | None) -> RankChannel | None:
    """The runtime's signals for this rank: its controller's store (`tenplex run`), its agent's (a worker
    of `tenplex agent`), or none (a script on its own, or under torchrun)."""
    if spec is not None and spec.control:
        return RankChannel(spec.control, spec.phase)
    placed, number = rounds.worker_agent(), os.environ.get(rounds.ROUND)
    if placed is not None and number:
        return RankChannel(placed[0], int(number), store=rounds.agent_store())
    return None


def stop_requested(path: str | None, channel: RankChannel | None, step: int) -> bool:
    """Whether to stop after step `step`: rank 0 looks for the stop file (`--stop-file`), every rank asks
    its runtime (its controller, or its own host's agent, whose stop may wait for a given step); all ranks
    agree through one all-reduce, so they stop together (at the asked step when any rank knew of it in
    time)."""
    asked = bool(path and dist.get_rank() == 0 and os.path.exists(path))
    return any_rank(asked or (channel is not None and channel.stop_asked(step)))
