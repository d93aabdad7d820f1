"""N-dimensional boxes: the half-open index ranges that name a piece of a tensor."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .errors import PTCError


@dataclass(frozen=True, slots=True)
class Box:
    """`[start, stop)` on every dimension, in global (or, after `relative_to`, local) coordinates."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.start) != len(self.stop):
            raise PTCError(f"box start {self.start} and stop {self.stop} differ in rank")
        for a, b in zip(self.start, self.stop):
            if not (isinstance(a, int) and isinstance(b, int)) or a < 0 or b < a:
                raise PTCError(f"invalid box [{self.start}, {self.stop})")

    def __reduce__(self) -> tuple:
        # pickled as its constructor call: the default for slotted dataclasses sets each field from Python,
        # which slows sending a snapshot's PTC to the other ranks (the save's `gather` phase)
        return Box, (self.start, self.stop)

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @classmethod
    def from_slices(cls, ranges: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> Box:
        return cls(tuple(a for a, _ in ranges), tuple(b for _, b in ranges))

    @property
    def ndim(self) -> int:
        return len(self.start)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def volume(self) -> int:
        return prod(self.shape)

    @property
    def empty(self) -> bool:
        return any(b == a for a, b in zip(self.start, self.stop))

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when it is empty (a 0-d box intersects itself)."""
        if other.ndim != self.ndim:
            raise PTCError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(b <= a for a, b in zip(start, stop)):
            return None
        return Box(start, stop)

    def overlaps(self, other: Box) -> bool:
        """Whether the two boxes share an element: `intersect` without making the box."""
        if other.ndim != self.ndim:
            raise PTCError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        return all(
            max(a, c) < min(b, d) for a, b, c, d in zip(self.start, self.stop, other.start, other.stop)
        )

    def contains(self, other: Box) -> bool:
        return all(
            sa <= oa and ob <= sb for sa, sb, oa, ob in zip(self.start, self.stop, other.start, other.stop)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box in the local coordinates of `outer` (which must contain it)."""
        if not outer.contains(self):
            raise PTCError(f"{self} is not inside {outer}")
        return Box(
            tuple(a - o for a, o in zip(self.start, outer.start)),
            tuple(b - o for b, o in zip(self.stop, outer.start)),
        )

    def shifted(self, origin: Box) -> Box:
        """The inverse of `relative_to`: local coordinates inside `origin` back to global ones."""
        return Box(
            tuple(a + o for a, o in zip(self.start, origin.start)),
            tuple(b + o for b, o in zip(self.stop, origin.start)),
        )

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop))

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in zip(self.start, self.stop)]

    @classmethod
    def from_json(cls, data: object) -> Box:
        if not isinstance(data, list) or not all(
            type(r) is list and len(r) == 2 and type(r[0]) is int and type(r[1]) is int for r in data
        ):
            raise PTCError(f"a box is a list of [start, stop] integer pairs, got {data!r}")
        return cls(tuple(r[0] for r in data), tuple(r[1] for r in data))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop)) + "]"


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """`torch.chunk` semantics: pieces of ceil(size/parts); the last ones may be smaller or empty."""
    step = -(-size // parts) if parts else 0
    start = min(index * step, size)
    return start, min(start + step, size)
