"""How one tensor lies on a mesh: per axis Replicate or Shard(dim), plus pipeline-stage ownership."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .box import Box, chunk_bounds
from .errors import PTCError
from .mesh import Mesh

PIPELINE_AXIS = "pp"


@dataclass(frozen=True, slots=True)
class Shard:
    """Split along tensor dimension `dim` with torch.chunk semantics (DTensor's `Shard`)."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


AxisPlacement = Shard | Replicate


@dataclass(frozen=True, slots=True)
class Placement:
    """`shards` maps a mesh axis to the tensor dim it splits; every other axis replicates.

    `stages` lists the pipeline coordinates that hold the tensor (None: every coordinate). Axes that shard
    the same dim split it in mesh order, like DTensor's `[Shard(0), Shard(0)]`.
    """

    shards: tuple[tuple[str, int], ...] = ()
    stages: tuple[int, ...] | None = None

    @classmethod
    def of(cls, stages: int | tuple[int, ...] | None = None, **shards: int) -> Placement:
        st = (stages,) if isinstance(stages, int) else stages
        return cls(tuple(sorted(shards.items())), None if st is None else tuple(sorted(set(st))))

    def on(self, axis: str) -> AxisPlacement:
        for a, d in self.shards:
            if a == axis:
                return Shard(d)
        return Replicate()

    def check(self, mesh: Mesh, shape: tuple[int, ...], name: str = "") -> None:
        """Raise a clear error when this placement cannot describe `shape` on `mesh`."""
        what = f"tensor {name!r}: " if name else ""
        for axis, dim in self.shards:
            mesh.axis_index(axis)
            if axis == PIPELINE_AXIS and self.stages is not None:
                raise PTCError(f"{what}the pipeline axis cannot both own stages and shard dim {dim}")
            if not 0 <= dim < len(shape):
                raise PTCError(f"{what}Shard({dim}) on axis {axis!r} but the tensor has {len(shape)} dims")
        if self.stages is not None:
            pp = mesh.axis_size(PIPELINE_AXIS)
            if not self.stages or any(not 0 <= s < pp for s in self.stages):
                raise PTCError(f"{what}stages {self.stages} are outside a pipeline of {pp} stages")

    def box(self, mesh: Mesh, shape: tuple[int, ...], coords: tuple[int, ...]) -> Box:
        """The piece of a tensor of `shape` held at mesh `coords` (possibly empty)."""
        start, stop = [0] * len(shape), list(shape)
        for i, (axis, size) in enumerate(mesh.axes):
            dim = self.dim_of(axis)
            if dim is not None and size > 1:
                a, b = chunk_bounds(stop[dim] - start[dim], size, coords[i])
                start[dim], stop[dim] = start[dim] + a, start[dim] + b
        return Box(tuple(start), tuple(stop))

    def holds(self, mesh: Mesh, coords: tuple[int, ...]) -> bool:
        if self.stages is None or PIPELINE_AXIS not in mesh.names:
            return True
        return coords[mesh.axis_index(PIPELINE_AXIS)] in self.stages

    def dim_of(self, axis: str) -> int | None:
        for a, d in self.shards:
            if a == axis:
                return d
        return None

    def describe(self, mesh: Mesh) -> str:
        parts = [f"{a}={self.on(a)}" for a in mesh.names if a != PIPELINE_AXIS or self.stages is None]
        if self.stages is not None:
            parts.append("stages=" + ",".join(map(str, self.stages)))
        return " ".join(parts)

    def to_json(self) -> dict:
        out: dict = {"shards": {a: d for a, d in self.shards}}
        if self.stages is not None:
            out["stages"] = list(self.stages)
        return out

    @classmethod
    def from_json(cls, data: dict) -> Placement | Explicit:
        if isinstance(data, dict) and "pieces" in data:
            return Explicit.from_json(data)
        try:
            shards = tuple(sorted((str(a), int(d)) for a, d in data.get("shards", {}).items()))
            stages = data.get("stages")
            return cls(shards, None if stages is None else tuple(int(s) for s in stages))
        except (AttributeError, TypeError, ValueError) as e:
            raise PTCError(f"malformed placement {data!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class Piece:
    """A distinct box of a tensor and the ranks that hold it (its replicas)."""

    box: Box
    holders: tuple[int, ...]

    def __reduce__(self) -> tuple:
        return Piece, (self.box, self.holders)  # see Box.__reduce__


@dataclass(frozen=True, slots=True)
class Explicit:
    """A layout listed piece by piece: whatever a framework produced (per-rank DTensor shards of any
    mesh, uneven or strided sharding, pipeline stages by presence), as long as the pieces tile the tensor."""

    pieces: tuple[Piece, ...]

    def __reduce__(self) -> tuple:
        return Explicit, (self.pieces,)  # see Box.__reduce__

    def check(self, mesh: Mesh, shape: tuple[int, ...], name: str = "") -> None:
        # every rank checks every tensor of the job on each load: plain loops over the coordinates, cheaper
        # than the generic Box methods for a few hundred tensors on every rank
        what = f"tensor {name!r}: " if name else ""
        ndim, ranks, total = len(shape), mesh.size, 0
        spans = []
        for p in self.pieces:
            start, stop = p.box.start, p.box.stop
            if len(start) != ndim or any(b > n for b, n in zip(stop, shape)):
                raise PTCError(f"{what}piece {p.box} lies outside the shape {list(shape)}")
            if not p.holders or min(p.holders) < 0 or max(p.holders) >= ranks:
                raise PTCError(f"{what}piece {p.box} has holders {p.holders} outside ranks 0..{ranks - 1}")
            total += prod(b - a for a, b in zip(start, stop))
            spans.append((start, stop))
        if total != prod(shape):
            raise PTCError(
                f"{what}pieces do not tile the tensor: their volumes do not add up to {list(shape)}"
            )
        if 1 < len(spans) <= 512:  # (0-d pieces: more than one fails the volumes above)
            # sorted along a dimension they are split on, a piece can only overlap those that start on
            # it before it ends there
            d = next((k for k in range(ndim) if spans[0][0][k] != spans[1][0][k]), 0)
            spans.sort(key=lambda sp: sp[0][d])
            for i, (a0, a1) in enumerate(spans):
                for b0, b1 in spans[i + 1 :]:
                    if b0[d] >= a1[d]:
                        break
                    if all(max(x0, y0) < min(x1, y1) for x0, x1, y0, y1 in zip(a0, a1, b0, b1)):
                        raise PTCError(f"{what}pieces {Box(a0, a1)} and {Box(b0, b1)} overlap")

    def describe(self, mesh: Mesh) -> str:
        return f"{len(self.pieces)} pieces"

    def to_json(self) -> dict:
        return {"pieces": [[p.box.to_json(), list(p.holders)] for p in self.pieces]}

    @classmethod
    def from_json(cls, data: dict) -> Explicit:
        try:
            return cls(tuple(Piece(Box.from_json(b), tuple(int(r) for r in h)) for b, h in data["pieces"]))
        except (KeyError, TypeError, ValueError) as e:
            raise PTCError(f"malformed explicit placement: {e}") from None


AnyPlacement = Placement | Explicit
