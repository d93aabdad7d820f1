"""What megatron-core 0.16.1 needs to run on the CPU with gloo: for the tests and examples/megatron_gpt.py.

Each patch names the CUDA-only spot it avoids; none of this is in `src/` (tenplex itself needs none of it:
a model on GPUs runs Megatron as it is). `on_cpu()` applies them all.
"""

from __future__ import annotations

import operator
import types
from functools import reduce

import torch
from megatron.core import parallel_state
from megatron.core import utils as mcore_utils
from megatron.core.pipeline_parallel import schedules
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


class _CpuZeros(types.ModuleType):
    """torch, with `zeros(..., device="cuda")` made on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def cpu_schedules() -> None:
    """The pipeline schedules count tokens in `torch.zeros([], device="cuda")`: their module sees a torch
    whose `zeros` makes that on the CPU. (The p2p module allocates on `torch.cuda.current_device()` and
    calls `torch.cuda.synchronize()`: `cuda_sync_stubs` covers it.)"""
    schedules.torch = _CpuZeros("torch")


def on_cpu() -> None:
    cpu_memory_buffer()
    cuda_sync_stubs()
    cpu_schedules()


def init_parallel(tp: int, pp: int = 1) -> None:
    """Megatron's process groups over the already initialized gloo world (rank order tp, dp, pp)."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def tiny_gpt(tp: int, pp: int = 1, seed: int = 0, **size: int):
    """`tenplex.integrations.megatron_train.tiny_gpt` seeded on the CPU: the same values in every layout."""
    from tenplex.integrations.megatron_train import tiny_gpt as build

    seed_all(seed)
    return build(tp, pp, **size)
