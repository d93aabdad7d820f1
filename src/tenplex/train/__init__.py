"""The reference workload: a GPT trained with tp, pp and dp (or FSDP) on torch.distributed.

Names are loaded lazily, so `tenplex.train.config` (flags) stays torch-free and the CLI starts fast (layouts
are `tenplex.ptc.layout`); `tenplex.data.sampler` never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "GPT": "model",
    "Layout": "tenplex.ptc.layout",
    "LayoutError": "tenplex.ptc.layout",
    "TrainConfig": "config",
    "Trainer": "trainer",
    "run_worker": "trainer",
    "build_mesh": "parallel",
    "build_model": "parallel",
    "job_state": "state",
    "load_job_state": "state",
    "full_model_state": "state",
    "train_locally": "launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _EXPORTS[name]
    return getattr(import_module(module if "." in module else f"{__name__}.{module}"), name)
