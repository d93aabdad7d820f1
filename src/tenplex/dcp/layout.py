"""DCP's load plans as the planner's input: the ranks' targets as a PTC, DCP's bytes as tensors.

The planner relates two PTCs. The snapshot's is the old one, with each of DCP's byte blobs added as a
uint8 tensor held by the rank that wrote it (`with_bytes`); the new one is what the ranks' `ReadItem`s ask
for (`targets`): each rank's chunk of a tensor is the box its items cover, as `tenplex.load` describes a
rank's shard, with the rank's store and device. A rank asking for two chunks of one tensor (a legacy
ShardedTensor) holds the second in a slot, a device of its own on the rank's store, as `StoreWriter` does.
The planner then splits every chunk at the stored pieces exactly as DCP splits it into read items, so each
fetch of the plan is one read item (`key`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ..ptc import PTC, Box, Explicit, Piece, TensorMeta
from ..transformer.gathered import RankShards, build_ptc
from .metadata import Stored


def key(tensor: str, box: Box) -> str:
    """The executor's name for one read item of a rank: its tensor and its box in the global tensor."""
    return f"{tensor}{box}"


def global_box(item: ReadItem, s: Stored) -> Box:
    """The box of the global tensor (bytes: of the whole blob) a read item fills."""
    assert s.box is not None
    if item.type == LoadItemType.BYTE_IO:
        return s.box
    start = tuple(a + int(o) for a, o in zip(s.box.start, item.storage_offsets))
    return Box(start, tuple(a + int(n) for a, n in zip(start, item.lengths)))


def is_bytes(s: Stored, snapshot: PTC) -> bool:
    return s.blob and s.name not in snapshot.tensors


def with_bytes(snapshot: PTC, storage: Mapping[Any, Stored]) -> PTC:
    """The snapshot's PTC and DCP's byte blobs, each a uint8 tensor of one piece held by its writer."""
    raw = {s.name: s for s in storage.values() if is_bytes(s, snapshot)}
    if not raw:
        return snapshot
    entries = [(snapshot.tensors[n], snapshot.placements[n]) for n in snapshot.tensors]
    for name, s in raw.items():
        assert s.box is not None
        entries.append((TensorMeta(name, s.box.shape, "uint8"), Explicit((Piece(s.box, s.holders),))))
    return PTC.build(snapshot.mesh, entries, snapshot.values)


def targets(plans: list[LoadPlan], storage: Mapping[Any, Stored], snapshot: PTC) -> tuple[PTC, list[int]]:
    """The ranks' targets as a PTC (`prepare_local_plan` put each rank's store and device in its plan),
    tensors before bytes so that the bytes weigh on no tensor's source choice; and the rank of each of its
    devices (a slot's is the rank it serves)."""
    layouts = [RankShards(r, p.storage_data["store"], p.storage_data["device"]) for r, p in enumerate(plans)]
    owner = list(range(len(plans)))
    for r, p in enumerate(plans):
        devices = [r]  # the rank, then its slots
        for (name, _), (box, kind) in _chunks(p, storage, snapshot).items():
            k = next((i for i, d in enumerate(devices) if name not in layouts[d].tensors), len(devices))
            if k == len(devices):
                lay = layouts[r]
                devices.append(len(layouts))
                layouts.append(RankShards(len(layouts), lay.store, f"{lay.device}+{k}"))
                owner.append(r)
            layouts[devices[k]].tensors[name] = (*kind, (box.start, box.stop))
    new = build_ptc(layouts)
    order = sorted(new.tensors, key=lambda n: n not in snapshot.tensors)  # stable: bytes last
    return PTC.build(new.mesh, [(new.tensors[n], new.placements[n]) for n in order]), owner


def _chunks(
    p: LoadPlan, storage: Mapping[Any, Stored], snapshot: PTC
) -> dict[tuple[str, Any], tuple[Box, tuple[tuple[int, ...], str]]]:
    """Each target chunk of one rank's plan: the box its items cover and its tensor's shape and dtype as
    stored (the executor reads the stored dtype; DCP converts into the target's)."""
    out: dict[tuple[str, Any], tuple[Box, tuple[tuple[int, ...], str]]] = {}
    for item in p.items:
        s = storage[item.storage_index]
        if not s.blob:
            continue
        box = global_box(item, s)
        chunk = (s.name, item.dest_index.offset)
        if chunk in out:
            seen = out[chunk][0]
            lo = tuple(map(min, seen.start, box.start))
            box = Box(lo, tuple(map(max, seen.stop, box.stop)))
        meta = snapshot.tensors.get(s.name)
        out[chunk] = (box, (meta.shape, meta.dtype) if meta is not None else (box.shape, "uint8"))
    return out
