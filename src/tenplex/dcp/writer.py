"""`StoreWriter`: DCP's `StorageWriter` on the tensor stores.

Every rank writes the chunks DCP's planner gave it into its own host's store (shared memory on the same
host); the coordinator then commits the version on every store with one manifest, exactly as `tenplex.save`
does, so a torn save is never read and `tenplex.load` can read the snapshot too.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..ptc import Box
from ..ptc import values as value_codec
from ..store import NotFoundError, StoreClient
from ..store.keys import check_job, check_step
from ..transformer.errors import StateError
from ..transformer.gathered import RankShards, blob_name, build_ptc, describe
from ..transformer.shards import DTYPES, Staged
from ..transformer.snapshot import make_manifest
from ..transformer.stores import client, resolve
from .metadata import DCP_SECTION


@dataclass(frozen=True)
class Written:
    """What a rank wrote for one item (travels to the coordinator in `WriteResult.storage_data`)."""

    box: Box | None  # tensors: the chunk in the global tensor; None for bytes
    value: Any = None  # bytes that decode to plain data: the value, so that `tenplex.load` sees it too
    has_value: bool = False


class StoreWriter(StorageWriter):
    """Write a DCP checkpoint as version `step` of `job` in the tensor stores.

    `store`: this rank's store (default $TENPLEX_STORE, else the local default). `keep`: after the commit,
    keep only the newest `keep` committed versions. A `checkpoint_id` given to `dcp.save` that ends in a
    number (`"step-20"`, a torchtitan checkpoint folder) sets the step.
    """

    def __init__(self, job: str, step: int, *, store: str | None = None, keep: int | None = None) -> None:
        super().__init__()
        self.job, self.step = check_job(job), check_step(step)
        self.url = resolve(store)
        self.keep = keep
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self._ranks: list[dict[str, str]] = []

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)
        self.save_id = uuid.uuid4().hex  # tells this save's commits from an abandoned attempt at the step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives", True) is False:
            raise StateError("StoreWriter commits one version for all ranks: use_collectives=False cannot")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.job}@{self.step}", save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO and item.tensor_data.properties.dtype not in DTYPES:
                raise StateError(
                    f"tensor {item.index.fqn!r} has dtype {item.tensor_data.properties.dtype}, "
                    "which tenplex cannot store"
                )
        _replace_committed(client(self.url), self.job, self.step)  # before the plans are gathered
        device = describe(self.url, {}, {}).device
        return dataclasses.replace(plan, storage_data={"store": self.url, "device": device})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._ranks = [dict(p.storage_data) for p in plans]
        devices = [r["device"] for r in self._ranks]
        if len(set(devices)) != len(devices):
            raise StateError(f"two ranks claim the same device id: {devices} (set TENPLEX_DEVICE)")
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        own = client(self.url)
        own.create_version(self.job, self.step)
        results, seen = [], set()
        for item in plan.items:
            name = item.index.fqn
            if name in seen:
                raise StateError(f"{name!r} has more than one chunk on rank {self.rank}; tenplex stores one")
            seen.add(name)
            data = planner.resolve_data(item)
            blob = blob_name(self.rank, name)
            if item.type == WriteItemType.BYTE_IO:
                raw = np.frombuffer(data.getbuffer(), dtype=np.uint8)
                own.write_blob(self.job, self.step, blob, raw, "uint8")
                results.append(WriteResult(item.index, raw.nbytes, _as_value(raw)))
                continue
            t = data.detach()
            chunk = item.tensor_data.chunk
            box = Box(tuple(chunk.offsets), tuple(o + s for o, s in zip(chunk.offsets, chunk.sizes)))
            if t.device.type != "cpu":
                t = t.cpu()
            staged = Staged(t, fill=True).array
            own.write_blob(self.job, self.step, blob, staged, DTYPES[t.dtype])
            results.append(WriteResult(item.index, t.numel() * t.element_size(), Written(box)))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: one manifest for the whole save, committed on every store the ranks wrote to."""
        layouts = [RankShards(r, info["store"], info["device"]) for r, info in enumerate(self._ranks)]
        raw: dict[str, list[int]] = {}
        values: dict[str, Any] = {}
        blobs: dict[str, list[str]] = {info["store"]: [] for info in self._ranks}
        for r, written in enumerate(results):
            for wr in written:
                w, name = wr.storage_data, wr.index.fqn
                blobs[self._ranks[r]["store"]].append(blob_name(r, name))
                if w.box is None:
                    raw[name] = [r, wr.size_in_bytes]
                    if w.has_value:
                        values[name] = w.value
                    continue
                md = metadata.state_dict_metadata[name]
                layouts[r].tensors[name] = (
                    tuple(md.size),
                    DTYPES[md.properties.dtype],
                    (w.box.start, w.box.stop),
                )
        ptc = build_ptc(layouts, values)
        stores = sorted(blobs)
        manifest = make_manifest(self.job, self.step, ptc)
        manifest.update(save_id=self.save_id, stores=stores)  # DCP's storage_meta carries this save id
        manifest[DCP_SECTION] = {"bytes": raw}
        # where each store copies its committed versions, so a load can find them when it dies
        manifest["replicas"] = {u: client(u).health().get("replicas", []) for u in stores}
        for url in stores:
            client(url).commit(self.job, self.step, manifest, wait_replicas=True, blobs=blobs[url])
        if self.keep is not None:  # only once committed everywhere
            for url in stores:
                client(url).retain(self.job, self.keep, protect=(self.step, self.save_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never chosen by DCP on its own: pass the writer explicitly


def step_of(checkpoint_id: str | os.PathLike | int) -> int:
    """The step a DCP checkpoint_id names: an int, or a string or path ending in a number."""
    if isinstance(checkpoint_id, int):
        return check_step(checkpoint_id)
    m = re.search(r"(\d+)/*$", os.fspath(checkpoint_id))
    if m is None:
        raise StateError(f"checkpoint_id {checkpoint_id!r} names no step (expected it to end in a number)")
    return check_step(int(m.group(1)))


def _as_value(raw: np.ndarray) -> Written:
    """DCP's bytes of a non-tensor value; the value itself too when it is plain data a manifest holds
    (decoded with `weights_only`, so nothing but data is ever unpickled here)."""
    try:
        value = torch.load(io.BytesIO(raw.tobytes()), weights_only=True)
        value_codec.encode(value)
    except Exception:
        return Written(None)
    return Written(None, value, True)


def _replace_committed(own: StoreClient, job: str, step: int) -> None:
    """DCP's `save` to a checkpoint id that names a committed step replaces it (its writers carry no
    common save id to keep the old save readable beside the new one, as `tenplex.save` does)."""
    if step in own.versions(job):
        try:
            own.delete_version(job, step)
        except NotFoundError:  # another rank on this host deleted it first
            pass
