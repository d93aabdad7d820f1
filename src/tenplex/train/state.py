"""The job-state contract the state transformer and the runtime rely on.

`job_state(...)` returns one nested dict whose tensors carry *global* names and shapes in every layout:

    {"model":     {fqn: Tensor | DTensor},                      # get_model_state_dict
     "optim":     {"state.<fqn>.exp_avg" | ".exp_avg_sq" | ".step": Tensor,
                   "param_groups.<fqn>.<lr|betas|...>": value},  # get_optimizer_state_dict, flattened
     "scheduler": LambdaLR.state_dict(),
     "sampler":   ElasticSampler.state_dict(),                 # seed, epoch, consumed, global batch, N
     "rng":       {"torch": ByteTensor},                       # this rank's CPU generator
     "step":      int}

fqn are `tenplex.ptc.gpt.param_shapes` names. A rank holds only its pipeline stage's fqns. Under tp the
tp-sharded weights are DTensors on the tp sub-mesh (Shard(0)/Shard(1)), row-parallel biases DTensors with
Replicate(), layer norms and positions plain tensors (replicated). Under FSDP every parameter and moment is
a DTensor sharded Shard(0) over the dp sub-mesh (2-D (dp, tp) mesh when tp > 1). Plain tensors are full.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..data.sampler import ElasticSampler
from .optim import init_state

# optimizer state and hyperparameters keyed by parameter name ("state.<fqn>.exp_avg",
# "param_groups.<fqn>.lr"): a pipeline stage then holds exactly its own parameters' entries, whatever
# the layout that wrote them (as DCP recommends for resharding)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def job_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sampler: ElasticSampler,
    step: int,
) -> dict[str, Any]:
    """This rank's view of the whole job state, in global names and shapes (see the module docstring)."""
    init_state(optimizer)  # a fresh optimizer's state without DCP's step at lr 0
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=FLAT),
        "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "step": int(step),
    }


def load_job_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    sampler: ElasticSampler,
    state: dict[str, Any],
) -> int:
    """Restore `state` (as `job_state` returns it, filled for *this* layout) and return its step."""
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"], options=FLAT)
    scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    if "rng" in state:
        torch.set_rng_state(state["rng"]["torch"])
    return int(state["step"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stage gathered to its full global tensor (on every rank, on CPU)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}
