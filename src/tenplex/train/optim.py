"""AdamW with decoupled weight decay on matrices only, and a warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_optimizer(
    model: nn.Module, lr: float, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95)
) -> torch.optim.AdamW:
    """Matrices decay, vectors (biases, layer norms) do not: the usual GPT recipe."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: one rank's parameters mix DTensors (tp/fsdp) and plain tensors
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, foreach=False)


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh Adam or AdamW the state its first step at lr 0 leaves (step 1, zero moments) without
    running that step. DCP's `get_optimizer_state_dict` initializes a fresh optimizer so, and on DTensor
    parameters the step is a full pass of DTensor dispatch over every parameter: the largest part of a new
    layout's build before its load. The result is the same (the step at lr 0 changes no parameter bit).
    Other optimizers, and Adam variants whose step lives on the device (capturable, fused): left to DCP."""
    if optimizer.state or not isinstance(optimizer, torch.optim.Adam):
        return
    groups = optimizer.param_groups
    if any(g.get("capturable") or g.get("fused") or g.get("differentiable") for g in groups):
        return
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # Adam's own
    for group in groups:
        for p in (p for p in group["params"] if p.requires_grad):
            state = optimizer.state[p]
            state["step"] = torch.tensor(1.0, dtype=scalar)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class WarmupCosine:
    """lr multiplier: linear warm-up over `warmup` steps, then cosine down to `min_ratio` at `total`.

    A callable object rather than a closure so LambdaLR's state_dict records it.
    """

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.1) -> None:
        self.warmup, self.total, self.min_ratio = warmup, max(total, 1), min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, min_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, total, min_ratio))
