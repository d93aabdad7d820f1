"""DeepSpeed's own checkpoints into a job's snapshot, for `DeepSpeedState` to load in any dp size and stage.

DeepSpeed's universal checkpoint (`ds_to_universal`) holds every parameter whole: `zero/<param>/fp32.pt`,
`exp_avg.pt`, `exp_avg_sq.pt`, `step.pt`, the param groups in `zero/optimizer_state.pt`, and the engine's
counters, scheduler and buffers in `mp_rank_00_model_states.pt`. Those become the tensors and values
`DeepSpeedState` names (flattened parameters), saved from one process; a ZeRO 1/2/3 checkpoint folder
(`save_checkpoint`'s `global_stepN`) is first converted by DeepSpeed's own converter.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..ptc import TenplexError
from ..transformer import save
from .deepspeed import HYPER


class DeepSpeedCheckpointError(TenplexError):
    """A folder that is no DeepSpeed checkpoint this importer reads, or one whose state it cannot map."""


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)  # DeepSpeed pickles its own classes
    except FileNotFoundError:
        raise DeepSpeedCheckpointError(f"{path}: missing (not a DeepSpeed universal checkpoint?)") from None


def _model_states(folder: Path) -> dict[str, Any]:
    """Rank 0's model states (`mp_rank_00_model_states.pt`; ZeRO-3 writes one per rank, the same counters)."""
    files = sorted(folder.glob("*model_states.pt"))
    if not files:
        raise DeepSpeedCheckpointError(f"{folder}: no *model_states.pt (not a DeepSpeed checkpoint?)")
    return _load(files[0])


def _flat(path: Path) -> torch.Tensor:
    """One parameter's state, flattened: stages 1-2 write {"param": tensor, ...}, stage 3 the flat tensor."""
    loaded = _load(path)
    return (loaded["param"] if isinstance(loaded, dict) else loaded).reshape(-1)


def _optimizer_state(
    folder: Path, names: list[str], optim: dict
) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Per state key (`fp32` for the master weights, then the optimizer's: `exp_avg`, ...) each parameter
    flattened, and the scalar state (Adam's step: per parameter from stages 1-2, from the optimizer's own
    state dict from stage 3)."""
    first = folder / "zero" / names[0]
    keys = sorted(f.stem for f in first.glob("*.pt") if f.stem != "step")
    tensors = {k: {n: _flat(folder / "zero" / n / f"{k}.pt") for n in names} for k in keys}
    if (first / "step.pt").exists():
        return tensors, {"step": float(_load(first / "step.pt"))}
    state = next(iter(optim.get("optimizer_state_dict", {}).get("state", {}).values()), {})
    return tensors, {k: float(v) for k, v in state.items() if k not in keys and getattr(v, "ndim", 0) == 0}


def universal_state(folder: Path) -> dict[str, Any]:
    """The state dict `DeepSpeedState` gives for the engine that wrote `folder`, every tensor whole."""
    model, optim = _model_states(folder), _load(folder / "zero" / "optimizer_state.pt")
    groups = optim["param_groups"]
    if len(groups) != 1:
        raise DeepSpeedCheckpointError(f"{folder}: {len(groups)} param groups; one is mapped")
    names = [n for shapes in model["param_shapes"] for n in shapes]
    tensors, scalars = _optimizer_state(folder, names, optim)
    if "fp32" not in tensors:
        raise DeepSpeedCheckpointError(f"{folder / 'zero' / names[0]}: no fp32.pt (master weights)")
    settings = {k: v for k, v in groups[0].items() if k != "params" and isinstance(v, HYPER)}
    gas = model["ds_config"].get("gradient_accumulation_steps", 1)
    counters = {c: model[c] for c in ("global_steps", "global_samples", "skipped_steps")}
    return {
        "master": tensors.pop("fp32"),
        "optim": tensors,
        "groups": {0: {"settings": settings, "state": scalars}},
        "shapes": {n: list(s) for shapes in model["param_shapes"] for n, s in shapes.items()},
        "buffers": {n: t for n, t in model["module"].items() if n in set(model.get("buffer_names") or ())},
        "engine": {**counters, "micro_steps": model["global_steps"] * gas},
        **({"scheduler": model["lr_scheduler"]} if model.get("lr_scheduler") is not None else {}),
    }


def to_universal(folder: Path, out: Path) -> Path:
    """A ZeRO checkpoint folder converted by DeepSpeed's `ds_to_universal` (stages 1-2 need its
    `--inject_missing_state`; it is harmless for stage 3)."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(folder),
           "--output_folder", str(out), "--inject_missing_state"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise DeepSpeedCheckpointError(f"{folder}: DeepSpeed's ds_to_universal failed: {last}")
    return out


def import_checkpoint(
    folder: str | Path, job: str, *, step: int | None = None, store: str | None = None, **extra: Any
) -> int:
    """`folder` (universal, or ZeRO's `global_stepN`) as snapshot `step` of `job` (default: its global
    step); `extra`: what the script's `DeepSpeedState` holds besides the engine (e.g. `sampler=...`). The
    step saved."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DeepSpeedCheckpointError(f"{folder}: no such folder")
    if not (folder / "zero").is_dir() and not any(folder.glob("*optim_states.pt")):
        raise DeepSpeedCheckpointError(
            f"{folder}: neither a universal checkpoint (zero/) nor ZeRO's (*optim_states.pt): name the "
            "global_stepN folder"
        )
    with tempfile.TemporaryDirectory(prefix="tenplex-ds-universal-") as tmp:
        universal = folder if (folder / "zero").is_dir() else to_universal(folder, Path(tmp) / "universal")
        state = universal_state(universal)
        step = state["engine"]["global_steps"] if step is None else step
        save({**state, **extra}, job=job, step=step, store=store)
    return step
