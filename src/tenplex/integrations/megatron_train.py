"""A Megatron-core model and a plain PyTorch optimizer as the state an elastic script hands to `ElasticJob`.

Megatron's own optimizer (`DistributedOptimizer`, `Float16OptimizerWithFloat16Params`) and DDP wrapper
allocate on CUDA; a script that steps a `torch.optim` optimizer over the model's parameters keeps its
moments parameter-shaped, so each moment takes its parameter's layout: `optim.<state>.<name>`, cut like
the parameter `<name>` (`tenplex.integrations.megatron`). The names are the same in every TP/PP/DP
layout, so the moments reshard with the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from .megatron import MegatronLayoutError, as_tensors, sharded_tensors


def tiny_gpt(tp: int, pp: int = 1, *, hidden: int = 32, layers: int = 2, heads: int = 4, vocab: int = 128,
             seq: int = 16) -> GPTModel:  # fmt: skip
    """A GPTModel with the local (no Transformer Engine) layer spec in fp32, initialized on the CPU (the
    full master weights drawn from the CPU generator, then cut: the same values in every layout for one
    seed), no dropout. This rank's pipeline stage only: Megatron's parallel state and RNG must be set up."""
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


class MegatronState:
    """`state()` is the job's state dict (`model`, `optim` and the stateful `extra`, e.g. the sampler);
    `restore(state)` is a no-op (every tensor was loaded in place, the sampler through its own
    `load_state_dict`); `start_fresh()` clears the optimizer state `state()` had to create."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, group: Any = None, **extra: Any) -> None:
        self.model, self.optimizer, self.group, self.extra = model, optimizer, group, extra
        self._created_optimizer_state = False

    def __call__(self) -> dict[str, Any]:
        if not self.optimizer.state:
            _create_state(self.optimizer)
            self._created_optimizer_state = True
        sharded = sharded_tensors(self.model)
        moments, scalars = _moments(sharded, self.optimizer)
        optim = {**as_tensors(moments, self.group), **scalars}
        return {"model": as_tensors(sharded, self.group), "optim": optim, **self.extra}

    def restore(self, state: dict[str, Any]) -> None:
        pass

    def start_fresh(self) -> None:
        """No snapshot: the optimizer as fresh as in the script without tenplex (its step count at 0)."""
        if self._created_optimizer_state:
            self.optimizer.state.clear()
            self._created_optimizer_state = False


def _moments(
    sharded: dict[str, ShardedTensor], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, ShardedTensor], dict[str, torch.Tensor]]:
    """Every parameter's optimizer state: the parameter-shaped as ShardedTensors cut like the parameter,
    the scalars (Adam's step: the same on every rank holding the parameter) as they are."""
    by_storage = {st.data.data_ptr(): (name, st) for name, st in sharded.items()}
    out, scalars = {}, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.data_ptr() not in by_storage:
                raise MegatronLayoutError(
                    f"an optimizer parameter of shape {list(p.shape)} is in no ShardedTensor of the model"
                )
            name, st = by_storage[p.data_ptr()]
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    raise MegatronLayoutError(f"optimizer state {key!r} of {name} is not a tensor")
                if value.shape == p.shape:
                    out[f"{key}.{name}"] = dataclasses.replace(st, key=f"optim.{key}.{st.key}", data=value)
                elif value.dim() == 0:
                    scalars[f"{key}.{name}"] = value
                else:
                    raise MegatronLayoutError(f"optimizer state {key!r} of {name} is {list(value.shape)}")
    return out, scalars


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """One step at learning rate 0 on zero gradients, as DCP's state-dict API does: the optimizer's state
    exists (to be loaded into) and the parameters are unchanged."""
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
