"""The reference workload: a GPT trained with tp, pp and dp (or FSDP) on torch.distributed.

Names are loaded lazily, so `tenplex.train.config` / `.layout` (flags, layouts) stay torch-free and the CLI
starts fast; `tenplex.data.sampler` never imports torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "GPT": "model",
    "Layout": "layout",
    "LayoutError": "layout",
    "valid_layouts": "layout",
    "TrainConfig": "config",
    "Trainer": "worker",
    "run_worker": "worker",
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
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
