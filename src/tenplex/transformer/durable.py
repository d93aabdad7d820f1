"""The durable tier: a committed snapshot written in PyTorch DCP format, and loads from it.

Persisting assembles each tensor from the stores one at a time and hands DCP plain tensors, so the files
are ordinary DCP checkpoints that `torch.distributed.checkpoint.load` reads into any layout.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from ..ptc import PTC, Box
from ..ptc import values as value_codec
from ..store import StoreError
from .errors import KeyMismatchError, NoSnapshotError, ShapeMismatchError, StateError
from .gathered import blob_name
from .shards import DTYPES, Staged
from .snapshot import LoadInfo, choose
from .stores import client, resolve
from .tree import expand, flatten, restore

VALUES_KEY = "tenplex.values"
STEP_KEY = "tenplex.step"
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


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
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming single process" is noise here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path, no_dist=True)
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

    Keys and shapes are checked against the checkpoint's metadata and values before any tensor is written.
    """
    tree = expand(state_dict)
    tensors, values = flatten(tree)
    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise NoSnapshotError(f"cannot read a persisted snapshot at {path!r}: {e}") from None
    head: dict[str, Any] = {VALUES_KEY: "", STEP_KEY: 0}
    dcp.load(head, checkpoint_id=path, process_group=process_group)
    saved_values = value_codec.decode(json.loads(head[VALUES_KEY]))
    saved_names = set(meta) - set(head)
    missing = sorted((set(tensors) - saved_names) | (set(values) - set(saved_values)))
    unexpected = sorted((saved_names - set(tensors)) | (set(saved_values) - set(values)))
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
    dcp.load(state, checkpoint_id=path, process_group=process_group)
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
