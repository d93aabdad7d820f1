"""Hugging Face causal LMs from a small config (nothing is downloaded), FSDP2 over their decoder layers.

transformers 5.x builds `LlamaForCausalLM` / `Qwen2ForCausalLM` from a config in plain PyTorch modules;
FSDP2 shards each decoder layer and then the root (embeddings, final norm, lm head), as Accelerate's
FSDP2 plugin and torchtitan's HF backend do. gloo averages gradients with FSDP2's default reduction, so a
per-rank mean loss is the global mean's gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


def tiny_causal_lm(family: str = "llama", *, vocab: int = 256, hidden: int = 64, layers: int = 2,
                   heads: int = 4, seq: int = 64, seed: int = 0) -> nn.Module:  # fmt: skip
    """A randomly initialized causal LM of `family`, the same on every rank and in every layout."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {sorted(FAMILIES)}")
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return model_cls(config)


def shard(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over every decoder layer, then the root."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
