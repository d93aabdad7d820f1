"""`StoreWriter`: DCP's `StorageWriter` on the tensor stores.

Every rank writes the chunks DCP's planner gave it into its own host's store (shared memory on the same
host); the coordinator then commits the version through `tenplex.save`'s own commit (`transformer.commit`:
one manifest on every store, stamped with their replicas and incarnations, then retention), so a torn save
is never read and `tenplex.load` can read the snapshot too.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections import Counter
from collections.abc import Sequence
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
from ..store.keys import check_job, check_step
from ..transformer.commit import commit, replace_committed
from ..transformer.errors import StateError
from ..transformer.gathered import RankShards, blob_name, build_ptc, check_devices, describe
from ..transformer.shards import DTYPES, Staged, stored_dtype
from ..transformer.snapshot import make_manifest
from ..transformer.stores import client, resolve
from .location import location
from .metadata import DCP_SECTION, planner_data


@dataclass(frozen=True)
class Written:
    """What a rank wrote for one item (travels to the coordinator in `WriteResult.storage_data`)."""

    box: Box | None  # tensors: the chunk in the global tensor; None for bytes
    value: Any = None  # bytes that decode to plain data: the value, so that `tenplex.load` sees it too
    has_value: bool = False
    holder: int = 0  # the PTC device the blob belongs to: the rank, or a slot for its further chunks


class StoreWriter(StorageWriter):
    """Write a DCP checkpoint as version `step` of `job` in the tensor stores.

    A `checkpoint_id` (given here or to `dcp.save`) names the location instead: a step number of `job`, or a
    path mapped to a job and step by `tenplex.dcp.location`. `store`: this rank's store (default
    $TENPLEX_STORE, else the local default). `keep`: after the commit, keep only the newest `keep`
    committed versions. `overwrite`: replace a committed step (DCP's default), or raise as DCP does.
    `_extensions`: DCP's stream transforms (`ZStandard`, ...), accepted so that a `FileSystemWriter`'s
    arguments carry over, and not applied: a store keeps the bytes as written, for loads that read any byte
    range of them (a compressed stream can only be read whole); DCP's readers learn a checkpoint's
    transforms from its metadata, so a reader needs nothing either.
    """

    def __init__(
        self,
        job: str | None = None,
        step: int | None = None,
        *,
        checkpoint_id: str | os.PathLike | int | None = None,
        store: str | None = None,
        keep: int | None = None,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
    ) -> None:
        super().__init__()
        self.job = None if job is None else check_job(job)
        self.step = None if step is None else check_step(step)
        self.url = resolve(store)
        self.keep, self.overwrite = keep, overwrite
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self._ranks: list[dict[str, Any]] = []
        self._named: str | None = None  # the checkpoint_id path, as DCP's metadata names it
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is not None:
            self.job, self.step = location(checkpoint_id, self.job)
            self._named = None if isinstance(checkpoint_id, int) else os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex  # tells this save's commits from an abandoned attempt at the step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank") or 0)
        if kwargs.get("use_collectives", True) is False:
            raise StateError("StoreWriter commits one version for all ranks: use_collectives=False cannot")
        if self.job is None or self.step is None:
            raise StateError("StoreWriter needs a job and a step: StoreWriter(job, step), or a checkpoint_id")

    def storage_meta(self) -> StorageMeta | None:
        """The save's id, and its checkpoint id: the path it was given (as DCP's file system names it,
        which a load's metadata gives back), else `job@step`."""
        return StorageMeta(checkpoint_id=self._named or f"{self.job}@{self.step}", save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                stored_dtype(item.index.fqn, item.tensor_data.properties.dtype)
        replace_committed(client(self.url), self.job, self.step, self.overwrite)  # before plans are gathered
        device = describe(self.url, {}, {}).device
        info = {"store": self.url, "device": device, "at": (self.job, self.step)}
        return dataclasses.replace(plan, storage_data=info)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: the ranks agree on the location; a rank's further chunks of a tensor (a legacy
        ShardedTensor with several shards on one rank) get slots, PTC devices of their own on its store."""
        self._ranks = [dict(p.storage_data) for p in plans]
        devices = [r["device"] for r in self._ranks]
        check_devices(devices)
        places = {tuple(r["at"]) for r in self._ranks}
        if len(places) > 1:
            raise StateError(f"the ranks name different checkpoints: {sorted(places)} (same checkpoint_id)")
        out = []
        for r, p in enumerate(plans):
            chunks = Counter(i.index.fqn for i in p.items if i.type != WriteItemType.BYTE_IO)
            slots = [len(self._ranks) + k for k in range(max(chunks.values(), default=1) - 1)]
            for k, _ in enumerate(slots, start=1):
                self._ranks.append({**self._ranks[r], "device": f"{devices[r]}+{k}"})
            out.append(dataclasses.replace(p, storage_data={"holders": [r, *slots]}))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        own = client(self.url)
        own.create_version(self.job, self.step)
        results, count = [], Counter[str]()
        holders = plan.storage_data["holders"]
        for item in plan.items:
            name = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = np.frombuffer(data.getbuffer(), dtype=np.uint8)
                own.write_blob(self.job, self.step, blob_name(holders[0], name), raw, "uint8")
                results.append(WriteResult(item.index, raw.nbytes, _as_value(raw, holders[0])))
                continue
            holder = holders[count[name]]
            count[name] += 1
            t = data.detach()
            chunk = item.tensor_data.chunk
            box = Box(tuple(chunk.offsets), tuple(o + s for o, s in zip(chunk.offsets, chunk.sizes)))
            if t.device.type != "cpu":
                t = t.cpu()
            staged = Staged(t, fill=True).array
            own.write_blob(self.job, self.step, blob_name(holder, name), staged, DTYPES[t.dtype])
            results.append(WriteResult(item.index, t.numel() * t.element_size(), Written(box, holder=holder)))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: one manifest for the whole save, committed on every store the ranks wrote to."""
        layouts = [RankShards(r, info["store"], info["device"]) for r, info in enumerate(self._ranks)]
        raw: dict[str, list[int]] = {}
        values: dict[str, Any] = {}
        blobs: dict[str, list[str]] = {info["store"]: [] for info in self._ranks}
        for written in results:
            for wr in written:
                w, name = wr.storage_data, wr.index.fqn
                blobs[self._ranks[w.holder]["store"]].append(blob_name(w.holder, name))
                if w.box is None:
                    raw[name] = [w.holder, wr.size_in_bytes]
                    if w.has_value:
                        values[name] = w.value
                    continue
                md = metadata.state_dict_metadata[name]
                span = (w.box.start, w.box.stop)
                layouts[w.holder].tensors[name] = (tuple(md.size), DTYPES[md.properties.dtype], span)
        # DCP's storage_meta carries this save id; the stores are the ranks' (blobs' keys)
        manifest = make_manifest(self.job, self.step, build_ptc(layouts, values), save_id=self.save_id)
        named = {"checkpoint_id": self._named} if self._named else {}
        manifest[DCP_SECTION] = {"bytes": raw, **named, **planner_data(metadata)}
        commit(manifest, blobs, self.keep)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never chosen by DCP on its own: pass the writer explicitly


def _as_value(raw: np.ndarray, holder: int) -> Written:
    """DCP's bytes of a non-tensor value; the value itself too when it is plain data a manifest holds
    (decoded with `weights_only`, so nothing but data is ever unpickled here)."""
    try:
        value = torch.load(io.BytesIO(raw.tobytes()), weights_only=True)
        value_codec.encode(value)
    except Exception:
        return Written(None, holder=holder)
    return Written(None, value, True, holder)
