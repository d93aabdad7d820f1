"""A tenplex snapshot manifest seen as DCP `Metadata`, whichever front door wrote it.

The manifest's PTC names every piece of every tensor and the ranks whose stores hold it; DCP's metadata
names the same pieces as chunks. Values are either carried in the manifest (`tenplex.save`, and DCP values
that are plain data) or kept as the exact bytes DCP serialized (`manifest["dcp"]["bytes"]`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..ptc import PTC, Box, PTCError
from ..ptc import values as value_codec
from ..transformer.durable import TORCH_DTYPES

try:  # the version DCP's own file system writer stamps; absent in some releases
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover
    CURRENT_DCP_VERSION = None

# manifest key written by StoreWriter: {"bytes": {fqn: [holder, nbytes]}, "planner_data": encoded,
# "checkpoint_id": the path the save was given}
DCP_SECTION = "dcp"


def planner_data(metadata: Metadata) -> dict[str, Any]:
    """The save planner's own data (the default planner: how flat keys nest back into the state dict,
    which `dcp_to_torch_save` and loads by key need), when it is plain data a manifest holds."""
    if metadata.planner_data is None:
        return {}
    try:
        return {"planner_data": value_codec.encode(metadata.planner_data)}
    except PTCError:
        return {}


@dataclass(frozen=True)
class Stored:
    """Where one DCP item lives: a blob per holder rank (`box`: the piece, in the global tensor), or a value
    carried in the manifest (`blob` False)."""

    name: str
    holders: tuple[int, ...] = ()
    box: Box | None = None
    blob: bool = True
    value: Any = None

    def value_bytes(self) -> io.BytesIO:
        """The value as DCP's planners expect non-tensor data: `torch.save` bytes."""
        out = io.BytesIO()
        torch.save(self.value, out)
        out.seek(0)
        return out


def to_metadata(manifest: dict[str, Any], ptc: PTC) -> Metadata:
    """DCP metadata of a committed snapshot (`ptc`: its manifest's PTC)."""
    items: dict[str, Any] = {}
    storage: dict[MetadataIndex, Stored] = {}
    for name, meta in ptc.tensors.items():
        chunks = []
        for piece in ptc.pieces(name):
            chunks.append(ChunkStorageMetadata(torch.Size(piece.box.start), torch.Size(piece.box.shape)))
            storage[MetadataIndex(name, piece.box.start)] = Stored(name, piece.holders, piece.box)
        props = TensorProperties(dtype=TORCH_DTYPES[meta.dtype])
        items[name] = TensorStorageMetadata(props, torch.Size(meta.shape), chunks)
    raw = manifest.get(DCP_SECTION, {}).get("bytes", {})  # DCP's bytes: a blob each
    for name, (rank, nbytes) in raw.items():
        items[name] = BytesStorageMetadata()
        storage[MetadataIndex(name)] = Stored(name, (int(rank),), Box.full((int(nbytes),)))
    for name, value in ptc.values.items():
        if name not in raw:
            items[name] = BytesStorageMetadata()
            storage[MetadataIndex(name)] = Stored(name, blob=False, value=value)
    section = manifest.get(DCP_SECTION, {})
    return Metadata(
        state_dict_metadata=items,
        planner_data=value_codec.decode(section["planner_data"]) if "planner_data" in section else None,
        storage_data=storage,
        storage_meta=StorageMeta(
            checkpoint_id=section.get("checkpoint_id", f"{manifest['job']}@{manifest['step']}"),
            save_id=manifest.get("save_id"),
        ),
        version=CURRENT_DCP_VERSION,
    )
