"""Megatron `torch_dist` checkpoints into a job's snapshots and back, through Megatron's own loader and saver.

A `torch_dist` checkpoint is read by `dist_checkpointing.load` into the model of whatever layout the job
runs now (Megatron reshards on read), then saved to the stores; an export loads the job's snapshot into
the model and writes it with `dist_checkpointing.save`, which any layout can load. Both are collective over
the job's ranks and need the model (its `sharded_state_dict()` says what each rank reads and writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing

from ..transformer import LoadInfo, SaveHandle, load, save
from .megatron import model_state


def import_torch_dist(model: Any, path: str | Path, job: str, step: int, **save_kwargs: Any) -> SaveHandle:
    """The checkpoint at `path` into `model` (in place), then saved as `step` of `job`."""
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(path)))
    return save({"model": model_state(model), "step": step}, job, step, **save_kwargs)


def export_torch_dist(model: Any, job: str, path: str | Path, **load_kwargs: Any) -> LoadInfo:
    """The job's newest snapshot (or `step=`) into `model` (in place), then written to `path` (a new,
    empty folder) as a `torch_dist` checkpoint."""
    state = {"model": model_state(model), "step": 0}
    info = load(state, job, **load_kwargs)
    Path(path).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(path))
    return info
