"""torchtitan's Llama 3 on CPU/gloo: its own model code and its own `parallelize_llama` (FSDP2 + TP).

What torchtitan 0.3.0 needs on a CPU machine, and why each step is here:
- its device type is decided at import (`cuda` when no accelerator is found): forced to `cpu`;
- flex attention needs `torch.compile`, and 0.3.0 refuses SDPA by name for language models, so the
  layers are built with its `ScaledDotProductAttention` module directly (causal, no per-document masks);
- fused QKV breaks DCP's `get_model_state_dict` (`'FusedQKVLinear' object has no attribute 'wq'`):
  built with `fuse_qkv=False`;
- gloo has no PREMUL_SUM: every FSDP2 module gets `set_force_sum_reduction_for_comms(True)`;
- the "spmd_types" / "full_dtensor" backends want every parameter a DTensor on the full mesh, which
  its embeddings are not on CPU: the "partial_dtensor" backend is used (TP by DTensor, FSDP2 over dp);
- the model's sharding declarations are filled by `Trainer.Config` normally (`update_from_config`,
  which imports the data loader stack): `set_llama3_sharding_config` is called directly.
The result on a (dp 2, tp 2) mesh has `_StridedShard` placements, as on GPUs.

torchtitan's FSDP2 sums gradients over the dp ranks (its `disable_fsdp_gradient_division`): the loss must
be normalized by the global token count, as its trainer does (`global_loss`). A per-rank mean loss makes
the gradient scale with dp, which Adam hides in a static run but not across a dp change: the losses of a
2 -> 3 ranks run leave a static run's at once (`tests/test_titan.py` holds them to it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torchtitan.tools.utils as titan_utils
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models import llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

BACKEND = "partial_dtensor"


@dataclass(frozen=True)
class TinyLlama:
    """torchtitan's `debugmodel` (dim 256, 6 layers, 16 heads, vocab 2048), shrunk for CPU tests."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab: int = 256  # tenplex's byte-level corpus
    max_seq_len: int = 64


def force_cpu() -> None:
    """torchtitan's modules read `device_type` from `torchtitan.tools.utils` at import time."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(mod, "device_type", None) == "cuda":
            mod.device_type = "cpu"
    titan_utils.device_type = "cpu"


def llama3_config(size: TinyLlama = TinyLlama(), *, enable_sp: bool = True) -> Llama3Model.Config:
    """The `debugmodel` recipe from torchtitan's own building blocks, with SDPA and unfused QKV."""
    init = llama3  # the inits torchtitan's registry uses
    rope = ComplexRoPE.Config(
        dim=size.dim // size.n_heads, max_seq_len=size.max_seq_len, theta=500000, scaling="llama"
    )
    hidden = compute_ffn_hidden_dim(size.dim, multiple_of=64)
    layers = []
    for i in range(size.n_layers):
        layers.append(
            Llama3TransformerBlock.Config(
                attention_norm=RMSNorm.Config(normalized_shape=size.dim, param_init=init._NORM_INIT),
                ffn_norm=RMSNorm.Config(normalized_shape=size.dim, param_init=init._NORM_INIT),
                attention=make_gqa_config(
                    dim=size.dim,
                    n_heads=size.n_heads,
                    wqkv_param_init=init._LINEAR_INIT,
                    wo_param_init=init._depth_init(i),
                    inner_attention=ScaledDotProductAttention.Config(),
                    fuse_qkv=False,
                    rope=rope,
                ),
                feed_forward=make_ffn_config(
                    dim=size.dim,
                    hidden_dim=hidden,
                    w1_param_init=init._LINEAR_INIT,
                    w2w3_param_init=init._depth_init(i),
                ),
            )
        )
    cfg = Llama3Model.Config(
        dim=size.dim,
        vocab_size=size.vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=size.vocab, embedding_dim=size.dim, param_init=init._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=size.dim, param_init=init._NORM_INIT),
        lm_head=Linear.Config(
            in_features=size.dim, out_features=size.vocab, param_init=init._output_linear_init(size.dim)
        ),
        layers=layers,
    )
    set_llama3_sharding_config(cfg, enable_sp=enable_sp)
    return cfg


def build_llama3(size: TinyLlama = TinyLlama(), *, seed: int = 0) -> nn.Module:
    """The whole model on CPU, initialized by torchtitan, the same in every layout (seeded)."""
    force_cpu()
    torch.manual_seed(seed)
    model = llama3_config(size).build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def parallelize(model: nn.Module, world: int, tp: int) -> ParallelDims:
    """torchtitan's `parallelize_llama` on a CPU (dp, tp) mesh in fp32: TP (with sequence parallelism)
    when tp > 1, FSDP2 over the dp ranks. Rank r is dp rank r // tp."""
    force_cpu()
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=1, world_size=world, spmd_backend=BACKEND
    )
    dims.build_mesh()
    llama3.parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(tensor_parallel_degree=tp, spmd_backend=BACKEND),
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=".",
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return dims


def global_loss(out: torch.Tensor, targets: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """This rank's share of the global mean cross entropy (token losses summed, divided by the tokens of
    the whole global batch): the gradients FSDP2 sums over dp ranks are then the global mean's."""
    out = out.full_tensor() if hasattr(out, "full_tensor") else out  # a DTensor if the lm head is sharded
    flat = out.reshape(-1, out.shape[-1])
    return nn.functional.cross_entropy(flat, targets.reshape(-1), reduction="sum") / global_tokens
