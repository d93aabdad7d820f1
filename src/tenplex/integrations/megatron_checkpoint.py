"""Megatron `torch_dist` checkpoints into a job's snapshots and back, without the model.

A `torch_dist` folder is a PyTorch DCP checkpoint (plus Megatron's `metadata.json` and `common.pt`) whose
items are Megatron's checkpoint keys at their global shapes (stacked layers included) and its objects as
`<key>/shard_<offset>_<shape>`. tenplex names a Megatron model's state by exactly those keys and shapes
(`tenplex.integrations.megatron`), so the import reads every item whole, as the checkpoint's metadata
describes it, and saves it as the tensor `model.<key>` from one process; the export assembles the
snapshot's `model.*` tensors and writes them back under the same keys. Nothing needs to know which axes are
stacked layers (the checkpoint does not record it), and any TP/PP/DP layout loads the result. Megatron's
own `dist_checkpointing.load` reads what the export writes. What is not a model tensor or a `None` object
(optimizer state in Megatron's format, a non-empty common state) is refused, naming it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..ptc import TenplexError
from ..transformer import save
from ..transformer.durable import assemble

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}  # fmt: skip
PREFIX = "model."
T = TypeVar("T")


class MegatronCheckpointError(TenplexError):
    """A folder that is no `torch_dist` checkpoint, or state this importer/exporter cannot map."""


def read_torch_dist(folder: str | Path) -> dict[str, Any]:
    """Every item of the checkpoint at `folder`, whole: tensors by key, objects (which must be `None`) by
    their shard key."""
    folder = Path(folder)
    meta_file = folder / "metadata.json"
    if not meta_file.is_file():
        raise MegatronCheckpointError(
            f"{folder}: no metadata.json (not a Megatron dist_checkpointing folder)"
        )
    backend = json.loads(meta_file.read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{folder}: sharded_backend {backend!r}; tenplex reads 'torch_dist'")
    common = _common(folder)
    if common:
        raise MegatronCheckpointError(
            f"{folder}: common state {sorted(common)} (not sharded) is not mapped; tenplex imports a model's "
            "sharded tensors (save the model's sharded_state_dict() alone)"
        )
    items: dict[str, Any] = {}
    metadata = _read(folder, ".metadata", FileSystemReader(str(folder)).read_metadata)
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("optimizer."):
            raise MegatronCheckpointError(f"{folder}: {key}: Megatron's optimizer state is not mapped")
        if isinstance(md, TensorStorageMetadata):
            items[key] = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            items[key] = io.BytesIO()
    with warnings.catch_warnings():  # one process on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _read(folder, "the tensors", dcp.load, items, checkpoint_id=str(folder), no_dist=True)
    for key, item in items.items():  # DCP's planner hands an object back unpickled: the list of the data of
        # the objects of that key on the rank that wrote it (strategies/torch.py)
        if not isinstance(item, torch.Tensor):
            if not (isinstance(item, list) and all(x is None for x in item)):
                raise MegatronCheckpointError(
                    f"{folder}: {key} is an object ({item!r:.60}); tenplex holds Megatron's None objects"
                )
            items[key] = None
    return items


def _common(folder: Path) -> Any:
    """`common.pt`, never unpickled as code: what is not plain data (Megatron-LM's `args`) is refused as a
    common state anyway."""
    try:
        common = torch.load(folder / "common.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return {"objects that are not plain data": None}
    except Exception as e:  # a missing or torn file: one line naming it
        return _read(folder, "common.pt", _raise, e)
    if not isinstance(common, dict):  # importing megatron.core allows `argparse.Namespace` and others to
        return {"objects that are not plain data": None}  # load as weights: refused here all the same
    return {str(k): v for k, v in common.items()}


def _raise(e: BaseException) -> None:
    raise e


def _read(folder: Path, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(...)`, its failure one line naming the folder and the file (a missing or torn checkpoint)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # torch's and DCP's many exception types: the message is what tells the user
        cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise MegatronCheckpointError(f"{folder}: cannot read {what}: {cause}") from e


def import_checkpoint(
    folder: str | Path, job: str, *, step: int | None = None, store: str | None = None
) -> int:
    """`folder` as snapshot `step` of `job` (default: N of a folder named `iter_N`, else 0): the state
    `{"model": model_state(model)}` loads in any layout. The step saved."""
    if not Path(folder).is_dir():
        raise MegatronCheckpointError(f"{folder}: no such folder")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise MegatronCheckpointError(
            "import a checkpoint from one process (as `tenplex import megatron` does): in a process group "
            f"of {dist.get_world_size()} ranks the save would wait for the others"
        )
    items = read_torch_dist(folder)
    if step is None:
        m = re.fullmatch(r"iter_(\d+)", Path(folder).resolve().name)
        step = int(m.group(1)) if m else 0
    save({"model": items}, job=job, step=step, store=store)
    return step


def export_checkpoint(
    job: str, path: str | Path, *, step: int | None = None, store: str | None = None
) -> dict:
    """Snapshot `step` (default: the newest) of `job`, its `model.*` tensors and objects, written to `path`
    (which must not exist) as a `torch_dist` checkpoint. What was written, and what was left out."""
    path = Path(path)
    if path.exists():
        raise MegatronCheckpointError(f"{path}: exists; name a new folder")
    step, ptc, tensors = assemble(job, step, store=store)
    state: dict[str, Any] = {n[len(PREFIX) :]: t for n, t in tensors.items() if n.startswith(PREFIX)}
    if not state:
        raise MegatronCheckpointError(f"job {job} step {step} holds no Megatron model (model.* tensors)")
    for name, value in ptc.values.items():
        if name.startswith(PREFIX) and value is None:
            # as Megatron writes one rank's objects of that key; DCP pickles it
            state[name[len(PREFIX) :]] = [None]
    tmp = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        (tmp / "metadata.json").write_text(json.dumps(BACKEND))
        torch.save({}, tmp / "common.pt")
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    left = sorted(n for n in [*tensors, *ptc.values] if not n.startswith(PREFIX))
    written = sum(isinstance(v, torch.Tensor) for v in state.values())
    return {"job": job, "step": step, "path": str(path), "tensors": written, "left_out": left}
