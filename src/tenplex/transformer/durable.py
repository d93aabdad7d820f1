"""The durable tier: a committed snapshot written in PyTorch DCP format, and loads from it.

Persisting assembles each tensor from the stores one at a time and hands DCP plain tensors, so the files
are ordinary DCP checkpoints that `torch.distributed.checkpoint.load` reads into any layout.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from ..ptc import PTC, Box
from ..ptc import values as value_codec
from ..store import StoreError
from . import world
from .errors import DurableError, KeyMismatchError, NoSnapshotError, ShapeMismatchError, StateError
from .gathered import blob_name
from .shards import DTYPES, Staged
from .snapshot import LoadInfo, choose
from .stores import client, resolve
from .tree import expand, flatten, restore

VALUES_KEY = "tenplex.values"
STEP_KEY = "tenplex.step"
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}
T = TypeVar("T")


def persist(job: str, step: int | None, path: str, *, store: str | None = None) -> dict[str, Any]:
    """Write version `step` (default: the newest committed) of `job` to `path` as a DCP checkpoint.

    Run it in one process (a rank, the runtime or the CLI); it reads each piece from a store that holds it.
    """
    started = time.perf_counter()
    step, ptc, tensors = assemble(job, step, store=store)
    state: dict[str, Any] = dict(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    state[VALUES_KEY] = json.dumps(value_codec.encode(ptc.values))
    state[STEP_KEY] = step
    tmp = Path(path).parent / f".{Path(path).name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        with warnings.catch_warnings():  # one process on purpose: DCP's "assuming single process" is noise
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _dcp(dcp.save, f"persisting step {step} to {path}", state, checkpoint_id=str(tmp), no_dist=True)
        _swap(tmp, Path(path))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"job": job, "step": step, "path": path, "bytes": nbytes, "seconds": time.perf_counter() - started}


def assemble(
    job: str, step: int | None = None, *, store: str | None = None
) -> tuple[int, PTC, dict[str, torch.Tensor]]:
    """Every tensor of a committed snapshot as one full tensor, each piece read from a store holding it
    (for persisting, and for comparing two runs' states)."""
    snap = choose(job, step, [resolve(store)])  # what a load would take: one complete save
    step, ptc, save_id = snap.step, snap.ptc, snap.manifest.get("save_id")
    out = {}
    for name, meta in ptc.tensors.items():
        full = torch.empty(meta.shape, dtype=TORCH_DTYPES[meta.dtype])
        array = Staged(full, fill=False).array
        for piece in ptc.pieces(name):
            _read_piece(ptc, job, step, name, piece, array[(*piece.box.slices(), ...)], save_id)
        out[name] = full
    return step, ptc, out


def _read_piece(ptc: PTC, job: str, step: int, name: str, piece: Any, out: Any, save_id: str | None) -> None:
    """One piece from a store holding it, of the chosen save only (a version saved again meanwhile, e.g.
    during `keep` rotation, answers NotFound instead of mixing another save into the checkpoint)."""
    errors = []
    buf = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
    for r in piece.holders:
        try:
            box = Box.full(piece.box.shape)
            client(ptc.mesh.hosts[r]).read_box(job, step, blob_name(r, name), box, buf, save_id)
            if buf is not out:
                out[...] = buf
            return
        except StoreError as e:
            errors.append(f"rank {r}: {e}")
    raise StateError(f"no copy of {name} {piece.box} could be read: {'; '.join(errors)}")


def _name(dtype: Any) -> str:
    return DTYPES.get(dtype, str(dtype))


def load_durable(
    state_dict: dict[str, Any],
    path: str,
    *,
    strict: bool,
    started: float,
    reason: str | None,
    process_group: Any = None,
) -> LoadInfo:
    """Load the target from a DCP checkpoint written by `persist` (DCP reshards into any layout).

    Keys, shapes and dtypes are checked against the checkpoint's metadata first; the tensors are read into
    staging copies, and the targets are written only once every rank read all of its part (a torn
    checkpoint leaves every target as it was). NoSnapshotError only when `path` holds no checkpoint."""
    tree = expand(state_dict)
    tensors, values = flatten(tree)
    if not world.decide(lambda: (Path(path) / ".metadata").is_file(), process_group):  # one answer for all
        raise NoSnapshotError(f"no persisted snapshot at {path!r}")
    what = f"the persisted snapshot at {path!r}"
    meta = _dcp(lambda: dcp.FileSystemReader(path).read_metadata().state_dict_metadata, what)
    head: dict[str, Any] = {VALUES_KEY: "", STEP_KEY: 0}
    _dcp(dcp.load, what, head, checkpoint_id=path, process_group=process_group)
    try:
        saved_values = value_codec.decode(json.loads(head[VALUES_KEY]))
    except (ValueError, TypeError) as e:
        raise DurableError(f"{what} holds no readable values: {e}") from None
    saved_names = set(meta) - set(head)
    missing = sorted((set(tensors) - saved_names) | (set(values) - set(saved_values)))
    # what no rank of the job holds (a pipeline stage holds only its own layers' tensors)
    held = set().union(*world.all_gather(sorted(tensors) + sorted(values), process_group))
    unexpected = sorted((saved_names | set(saved_values)) - held)
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected)
    state = {n: t for n, t in tensors.items() if n in saved_names}
    for name, t in state.items():
        size = tuple(getattr(meta[name], "size", ()))
        dtype = getattr(getattr(meta[name], "properties", None), "dtype", None)
        if size != tuple(t.shape) or dtype != t.dtype:  # DCP would cast a dtype silently
            raise ShapeMismatchError(
                f"tensor {name!r} is {_name(dtype)}{list(size)} in {path} "
                f"but {_name(t.dtype)}{list(t.shape)} in the target"
            )
    staged = {n: torch.empty_like(t) for n, t in state.items()}  # DTensors keep their mesh and placements
    _dcp(dcp.load, what, staged, checkpoint_id=path, process_group=process_group)  # raises on every rank
    with torch.no_grad():
        for name, t in state.items():
            _local(t).copy_(_local(staged[name]))
    restore(state_dict, tree, {k: v for k, v in saved_values.items() if k in values})
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return LoadInfo(
        job="",
        step=int(head[STEP_KEY]),
        seconds=time.perf_counter() - started,
        bytes={"durable": nbytes},
        missing=missing,
        unexpected=unexpected,
        source="durable",
        note=reason or "",
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _dcp(fn: Callable[..., T], what: str, *args: Any, **kwargs: Any) -> T:
    """A DCP call whose failures are tenplex's: DCP raises `CheckpointException`, a BaseException that a
    user's `except Exception` would not catch, and torch's own errors from deep inside."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise DurableError(f"{what} failed: {_cause(e)}") from None


def _cause(e: BaseException) -> str:
    """One line: a CheckpointException's first rank's own error (its message is only the ranks' list)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items(), key=lambda kv: kv[0])[0]
        inner = getattr(inner, "exception", inner)
        return f"rank {rank}: {_cause(inner) if isinstance(inner, BaseException) else inner}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _swap(new: Path, path: Path) -> None:
    """`new` becomes `path` whole: a persist that fails midway leaves the checkpoint before it in place
    (put back if the second rename fails). Between the two renames `path` is briefly absent: a crash
    exactly there leaves the earlier checkpoint as `.NAME.old-*` beside it."""
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        if path.exists():
            os.rename(path, old)
        try:
            os.rename(new, path)
        except OSError:
            if old.exists():
                os.rename(old, path)
            raise
    except OSError as e:
        raise DurableError(f"persisting to {path} failed: {e}") from None
    shutil.rmtree(old, ignore_errors=True)
