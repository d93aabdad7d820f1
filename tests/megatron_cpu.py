"""What megatron-core 0.16.1 needs to run on a CPU-only machine with gloo, for the tests only.

Each patch names the CUDA-only spot it avoids; none of this is in `src/` (tenplex itself needs none of it:
on a GPU, Megatron runs as it is). `on_cpu()` applies them all, once per process.
"""

from __future__ import annotations

import operator
from functools import reduce

import torch
from megatron.core import parallel_state
from megatron.core import utils as mcore_utils
from megatron.core.tensor_parallel import random as mcore_random


def cpu_memory_buffer() -> None:
    """`GlobalMemoryBuffer.get_tensor` allocates on `torch.cuda.current_device()`; the local attention
    (`DotProductAttention`) and the TP all-gathers take their scratch from it: allocate on the CPU."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        need = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < need:
            buf = self.buffer[(name, dtype)] = torch.empty(need, dtype=dtype)
        return buf[:need].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor


def cuda_sync_stubs() -> None:
    """`dist_checkpointing.save` calls `torch.cuda.synchronize()` and allocates its failure flag on
    `torch.cuda.current_device()` even for CPU tensors: a no-op, and the CPU as the "current device"."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: torch.device("cpu")


def seed_all(value: int) -> None:
    """Megatron's default RNG tracker saves and restores CUDA RNG states around every TP-sharded init; the
    inference tracker (`inference_rng_tracker=True`) does not touch CUDA. With `use_cpu_initialization`
    the master weights come from the CPU generator, the same in every layout."""
    mcore_random.model_parallel_cuda_manual_seed(value, inference_rng_tracker=True, force_reset_rng=True)
    torch.manual_seed(value)


def on_cpu() -> None:
    cpu_memory_buffer()
    cuda_sync_stubs()


def init_parallel(tp: int, pp: int = 1) -> None:
    """Megatron's process groups over the already initialized gloo world (rank order tp, dp, pp)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def tiny_gpt(tp: int, pp: int = 1, seed: int = 0, *, hidden: int = 32, layers: int = 2, vocab: int = 128):
    """A GPTModel with the local (no Transformer Engine) layer spec, fp32, initialized on the CPU (the
    full master weights from the CPU generator, then cut: the same values in every layout for a seed).
    This rank's pipeline stage only; call `init_parallel(tp, pp)` first."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    seed_all(seed)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
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
        max_sequence_length=16,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
