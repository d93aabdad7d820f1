"""A job's snapshot (saved by `DeepSpeedState`) as a DeepSpeed universal checkpoint, for DeepSpeed's own
`load_checkpoint` (config `"checkpoint": {"load_universal": true}`) in any dp size and ZeRO stage 1-3.

The layout is what DeepSpeed's `ds_to_universal` writes: `FOLDER/global_stepN/zero/<param>/fp32.pt`,
`exp_avg.pt`, `exp_avg_sq.pt` and `step.pt` (each parameter whole, in its own shape), the param groups and
step in `zero/optimizer_state.pt` (in the keys stages 1-2 and stage 3 each read), the engine's counters,
scheduler, weights and buffers in `mp_rank_00_model_states.pt` (and its ZeRO-3 name), and
`FOLDER/latest_universal` naming the tag. The snapshot is read from the stores by one process.
"""

from __future__ import annotations

import shutil
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from ..ptc import TenplexError
from ..transformer.durable import assemble

MOMENTS = ("exp_avg", "exp_avg_sq")  # what DeepSpeed's universal loader reads besides fp32 (Adam's)
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stages 0-2, 3


class DeepSpeedExportError(TenplexError):
    """A snapshot that DeepSpeed's universal checkpoint cannot hold (not DeepSpeedState's, other state)."""


@dataclass
class _Saved:
    """What `DeepSpeedState` saved, per parameter (whole) and per value."""

    master: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    shapes: dict[str, list[int]]
    buffers: dict[str, torch.Tensor]
    settings: dict[str, Any]
    step: float
    engine: dict[str, int]
    scheduler: dict[str, Any] | None


def _under(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened state dict (a scheduler's) nested again at its dots."""
    out: dict[str, Any] = {}
    for name, v in flat.items():
        *path, last = name.split(".")
        at = out
        for k in path:
            at = at.setdefault(k, {})
        at[last] = v
    return out


def _moments(
    tensors: dict[str, torch.Tensor], names: list[str], what: str
) -> dict[str, dict[str, torch.Tensor]]:
    optim = _under(tensors, "optim.")
    keys = sorted({k.split(".", 1)[0] for k in optim})
    if extra := [k for k in keys if k not in MOMENTS]:
        raise DeepSpeedExportError(
            f"{what}: optimizer state {', '.join(extra)}: DeepSpeed's universal checkpoint holds Adam's "
            f"{' and '.join(MOMENTS)} only"
        )
    out = {k: _under(optim, f"{k}.") for k in MOMENTS}
    for k, per in out.items():
        if missing := [n for n in names if n not in per]:
            raise DeepSpeedExportError(
                f"{what}: no optimizer moment optim.{k}.{missing[0]} ({len(missing)} parameters without it): "
                "DeepSpeed's universal checkpoint holds fp32, exp_avg and exp_avg_sq of every parameter "
                "(save after the first step, or with Adam)"
            )
    return out


def _saved(tensors: dict[str, torch.Tensor], values: dict[str, Any], what: str) -> _Saved:
    master, shapes = _under(tensors, "master."), _under(values, "shapes.")
    if not master or not any(k.startswith("groups.") for k in values):
        raise DeepSpeedExportError(
            f"{what}: no master.* tensors and param groups: not a snapshot saved with DeepSpeedState "
            "(tenplex.integrations.deepspeed)"
        )
    groups = {k.split(".", 1)[0] for k in _under(values, "groups.")}
    if groups != {"0"}:
        raise DeepSpeedExportError(f"{what}: {len(groups)} param groups; one is mapped")
    for n, t in master.items():
        if n not in shapes:
            raise DeepSpeedExportError(
                f"{what}: no shape of {n} (shapes.*): save it with this tenplex's DeepSpeedState"
            )
        if t.numel() != torch.Size(shapes[n]).numel():
            raise DeepSpeedExportError(
                f"{what}: master.{n} has {t.numel()} elements, its shape {shapes[n]} not"
            )
    state = _under(values, "groups.0.state.")
    if set(state) != {"step"}:
        raise DeepSpeedExportError(
            f"{what}: optimizer values {sorted(state)}; the universal checkpoint holds a step"
        )
    scheduler = _under(values, "scheduler.")
    return _Saved(
        master=master,
        moments=_moments(tensors, list(master), what),
        shapes={n: shapes[n] for n in master},
        buffers=_under(tensors, "buffers."),
        settings={
            k: tuple(v) if isinstance(v, list) else v for k, v in _under(values, "groups.0.settings.").items()
        },
        step=state["step"],
        engine={k: int(v) for k, v in _under(values, "engine.").items()},
        scheduler=_nested(scheduler) if scheduler else None,
    )


def _ds_version() -> str:
    try:
        return version("deepspeed")
    except PackageNotFoundError:  # written without DeepSpeed installed: its loader wants some version
        return "0.0.0"


def _model_states(s: _Saved, dp: int) -> dict[str, Any]:
    """The engine's file: DeepSpeed's universal load takes the counters and the scheduler from it (the
    weights from zero/); the weights, buffers and shapes make it whole, as `save_checkpoint` writes it."""
    steps, micro = s.engine.get("global_steps", 0), s.engine.get("micro_steps", 0)
    gas = micro // steps if steps and micro % steps == 0 and micro else 1
    module = {n: t.view(s.shapes[n]) for n, t in s.master.items()}
    return {
        "module": {**module, **s.buffers},
        "buffer_names": list(s.buffers),
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(shape)) for n, shape in s.shapes.items())],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": s.scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": s.engine.get("skipped_steps", 0),
        "global_steps": steps,
        "global_samples": s.engine.get("global_samples", 0),
        "dp_world_size": dp,
        "mp_world_size": 1,
        "ds_config": {"gradient_accumulation_steps": gas},
        "ds_version": _ds_version(),
        "universal_checkpoint_info": {"universal_checkpoint_version": 0.4},
    }


def _optimizer_state(s: _Saved, step: torch.Tensor) -> dict[str, Any]:
    """Stages 1-2 read `param_groups` (and `ds_version`), stage 3 `optimizer_state_dict`'s groups and step."""
    return {
        "ds_version": _ds_version(),
        "param_groups": [{**s.settings, "params": [0]}],
        "optimizer_state_dict": {
            "state": {0: {"step": step}},
            "param_groups": [{**s.settings, "params": [0]}],
        },
    }


def _write(s: _Saved, out: Path, dp: int) -> None:
    step = torch.tensor(s.step, dtype=torch.float32)  # Adam's step, as torch keeps it
    for n, t in s.master.items():
        folder = out / "zero" / n
        folder.mkdir(parents=True)
        for key, full in (("fp32", t), *((k, s.moments[k][n]) for k in MOMENTS)):
            torch.save({"param": full.view(s.shapes[n]), "cat_dim": 0}, folder / f"{key}.pt")
        torch.save(step, folder / "step.pt")
    torch.save(_optimizer_state(s, step), out / "zero" / "optimizer_state.pt")
    for name in MODEL_STATES:
        torch.save(_model_states(s, dp), out / name)


def export_checkpoint(
    job: str, folder: str | Path, step: int | None = None, store: str | None = None
) -> Path:
    """Snapshot `step` (default: the newest committed) of `job` as `folder/global_step<step>`, a DeepSpeed
    universal checkpoint that `folder/latest_universal` names. The tag's folder written."""
    step, ptc, tensors = assemble(job, step, store=store)
    s = _saved(tensors, ptc.values, f"job {job} step {step}")
    folder = Path(folder)
    out = folder / f"global_step{step}"
    tmp = folder / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        _write(s, tmp, len(ptc.mesh.devices))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    (folder / "latest_universal").write_text(out.name)
    return out
