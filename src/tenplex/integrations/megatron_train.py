"""A Megatron-core model and a plain PyTorch optimizer as the state an elastic script hands to `ElasticJob`.

Megatron's own optimizer (`DistributedOptimizer`, `Float16OptimizerWithFloat16Params`) and DDP wrapper
allocate on CUDA; a script that steps a `torch.optim` optimizer over the model's parameters keeps its
moments parameter-shaped, so each moment takes its parameter's layout: `optim.<state>.<key>`, cut like
the parameter's checkpoint key `<key>` (`tenplex.integrations.megatron`); a scalar state (Adam's step) is
one element per stacked layer. The names are the same in every TP/PP/DP layout, so the moments reshard
with the weights.
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

from .megatron import MegatronLayoutError, ModelPieces, sharded_tensors


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
    `restore(state)` is a no-op (every tensor was loaded into the model and optimizer by the load itself,
    the sampler through its own `load_state_dict`); `start_fresh()` clears the optimizer state `state()` had
    to create."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, **extra: Any) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, extra
        self._created_optimizer_state = False

    def __call__(self) -> dict[str, Any]:
        if not self.optimizer.state:
            _create_state(self.optimizer)
            self._created_optimizer_state = True
        sharded, objects = sharded_tensors(self.model)
        moments = ModelPieces(_moments(sharded, self.optimizer), [])
        return {"model": ModelPieces(sharded, objects), "optim": moments, **self.extra}

    def restore(self, state: dict[str, Any]) -> None:
        pass

    def start_fresh(self) -> None:
        """No snapshot: the optimizer as fresh as in the script without tenplex (its step count at 0)."""
        if self._created_optimizer_state:
            self.optimizer.state.clear()
            self._created_optimizer_state = False


STACKED = ("global_shape", "global_offset", "axis_fragmentations")  # what a per-layer scalar keeps


def _moments(sharded: list[ShardedTensor], optimizer: torch.optim.Optimizer) -> list[ShardedTensor]:
    """Every parameter's optimizer state as ShardedTensors keyed `<state>.<parameter's key>`: the
    parameter-shaped cut like the parameter, a scalar (Adam's step) as one element per stacked layer
    (global shape: the key's stacked axes)."""
    by_storage = {st.data.data_ptr(): st for st in sharded}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = by_storage.get(p.data_ptr())
            if st is None:
                raise MegatronLayoutError(
                    f"an optimizer parameter of shape {list(p.shape)} is in no ShardedTensor of the model"
                )
            for key, value in optimizer.state.get(p, {}).items():
                name = f"{key}.{st.key}"
                if not isinstance(value, torch.Tensor):
                    raise MegatronLayoutError(f"optimizer state {name!r} is not a tensor")
                if value.shape == p.shape:
                    out.append(dataclasses.replace(st, key=name, data=value))
                elif value.dim() == 0:
                    k = st.prepend_axis_num  # the stacked axes only: one element per layer
                    cut = {
                        f: getattr(st, f)[:k]
                        for f in ("global_shape", "global_offset", "axis_fragmentations")
                    }
                    out.append(dataclasses.replace(st, key=name, data=value, local_shape=(), **cut))
                else:
                    raise MegatronLayoutError(f"optimizer state {name!r} is {list(value.shape)}")
    return out


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
