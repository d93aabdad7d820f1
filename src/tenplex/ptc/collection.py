"""The parallelizable tensor collection: tensors, mesh, placements and small values, as a manifest."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from itertools import product
from math import prod
from typing import Any

from . import values as value_codec
from .box import Box
from .dtypes import item_size
from .errors import PTCError
from .mesh import Mesh
from .placement import PIPELINE_AXIS, AnyPlacement, Explicit, Piece, Placement

MANIFEST_FORMAT = "tenplex.ptc"
MANIFEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor of the job: fully-qualified name, global shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise PTCError(f"tensor names must be non-empty strings, got {self.name!r}")
        if any(type(s) is not int or s < 0 for s in self.shape):
            raise PTCError(f"tensor {self.name!r} has an invalid shape {self.shape}")
        item_size(self.dtype)

    def __reduce__(self) -> tuple:
        return TensorMeta, (self.name, self.shape, self.dtype)  # see Box.__reduce__

    @property
    def itemsize(self) -> int:
        return item_size(self.dtype)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class LocalShard:
    """One piece of one tensor on one rank."""

    tensor: str
    box: Box
    rank: int


@dataclass(frozen=True)
class PTC:
    """A job's state layout. `values` carries the small non-tensor state (JSON-encodable, exactly)."""

    mesh: Mesh
    tensors: dict[str, TensorMeta]
    placements: dict[str, AnyPlacement]
    values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(self.tensors) ^ set(self.placements)
        if missing:
            raise PTCError(f"tensors and placements differ on {sorted(missing)[:5]}")
        checked: set[tuple[tuple[int, ...], AnyPlacement]] = set()  # a job's tensors share a few layouts
        for name, meta in self.tensors.items():
            if meta.name != name:
                raise PTCError(f"tensor registered as {name!r} is named {meta.name!r}")
            seen = (meta.shape, self.placements[name])
            if seen not in checked:
                seen[1].check(self.mesh, meta.shape, name)
                checked.add(seen)

    @classmethod
    def build(
        cls,
        mesh: Mesh,
        tensors: Iterable[tuple[TensorMeta, AnyPlacement]],
        values: dict[str, Any] | None = None,
    ) -> PTC:
        metas: dict[str, TensorMeta] = {}
        places: dict[str, AnyPlacement] = {}
        for meta, placement in tensors:
            if meta.name in metas:
                raise PTCError(f"tensor {meta.name!r} appears twice")
            metas[meta.name] = meta
            places[meta.name] = placement
        return cls(mesh, metas, places, dict(values or {}))

    @property
    def total_bytes(self) -> int:
        """Bytes of the state counted once (no replicas)."""
        return sum(m.nbytes for m in self.tensors.values())

    def meta(self, name: str) -> TensorMeta:
        try:
            return self.tensors[name]
        except KeyError:
            raise PTCError(f"unknown tensor {name!r}") from None

    def pieces(self, name: str) -> tuple[Piece, ...]:
        """The distinct non-empty boxes of a tensor with their holders, in a fixed order."""
        meta = self.meta(name)
        return self._pieces(meta.shape, self.placements[name])

    def _pieces(self, shape: tuple[int, ...], placement: AnyPlacement) -> tuple[Piece, ...]:
        if isinstance(placement, Explicit):
            return placement.pieces
        key = (shape, placement)
        cached = self._piece_cache.get(key)
        if cached is None:
            cached = self._piece_cache[key] = _layout(self.mesh, shape, placement)
        return cached

    @cached_property
    def _piece_cache(self) -> dict:
        return {}

    def shards(self, rank: int) -> list[LocalShard]:
        """Every non-empty piece rank `rank` holds."""
        coords = self.mesh.coords(rank)
        out = []
        for name, meta in self.tensors.items():
            placement = self.placements[name]
            if isinstance(placement, Explicit):
                out.extend(LocalShard(name, p.box, rank) for p in placement.pieces if rank in p.holders)
            elif placement.holds(self.mesh, coords):
                box = placement.box(self.mesh, meta.shape, coords)
                if not box.empty:
                    out.append(LocalShard(name, box, rank))
        return out

    def all_shards(self) -> Iterator[LocalShard]:
        for name in self.tensors:
            for piece in self.pieces(name):
                for r in piece.holders:
                    yield LocalShard(name, piece.box, r)

    # -- manifest ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "mesh": self.mesh.to_json(),
            "tensors": [
                {
                    "name": m.name,
                    "shape": list(m.shape),
                    "dtype": m.dtype,
                    "placement": self.placements[n].to_json(),
                }
                for n, m in self.tensors.items()
            ],
            "values": value_codec.encode(self.values),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, data: Any) -> PTC:
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise PTCError("not a tenplex PTC manifest (missing format 'tenplex.ptc')")
        version = data.get("version")
        if version != MANIFEST_VERSION:
            raise PTCError(
                f"manifest version {version!r} is not supported (this tenplex reads {MANIFEST_VERSION})"
            )
        mesh = Mesh.from_json(data.get("mesh", {}))
        try:
            entries = [
                (
                    TensorMeta(str(t["name"]), tuple(t["shape"]), str(t["dtype"])),
                    Placement.from_json(t.get("placement", {})),
                )
                for t in data["tensors"]
            ]
        except (KeyError, TypeError) as e:
            raise PTCError(f"malformed tensor entry in manifest: {e}") from None
        return cls.build(mesh, entries, value_codec.decode(data.get("values", {})))

    @classmethod
    def loads(cls, text: str | bytes) -> PTC:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise PTCError(f"manifest is not valid JSON: {e}") from None
        return cls.from_json(data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PTC):
            return NotImplemented
        return (
            self.mesh == other.mesh
            and self.tensors == other.tensors
            and self.placements == other.placements
            and self.values == other.values
        )

    __hash__ = None  # type: ignore[assignment]


def _layout(mesh: Mesh, shape: tuple[int, ...], placement: Placement) -> tuple[Piece, ...]:
    """Enumerate the coordinates of the sharding axes only; replicas follow from the other axes."""
    shard_axes = [i for i, (a, _) in enumerate(mesh.axes) if placement.dim_of(a) is not None]
    pp = mesh.names.index(PIPELINE_AXIS) if PIPELINE_AXIS in mesh.names else None
    fixed_base: dict[int, Any] = {}
    if placement.stages is not None and pp is not None:
        fixed_base[pp] = placement.stages
    pieces = []
    coords = [0] * len(mesh.axes)
    for combo in product(*(range(mesh.axes[i][1]) for i in shard_axes)):
        for i, c in zip(shard_axes, combo):
            coords[i] = c
        box = placement.box(mesh, shape, tuple(coords))
        if box.empty:
            continue
        fixed = dict(fixed_base)
        fixed.update(zip(shard_axes, combo))
        pieces.append(Piece(box, tuple(mesh.ranks_where(fixed))))
    return tuple(pieces)
