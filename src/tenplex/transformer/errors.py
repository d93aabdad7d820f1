"""Errors of `tenplex.save` / `tenplex.load`: each names the tensor or key and the cause."""

from __future__ import annotations

from ..ptc import TenplexError


class StateError(TenplexError):
    """A state dict tenplex cannot save or load as asked."""


class KeyMismatchError(StateError):
    """Keys of the target and of the snapshot differ (strict load)."""

    def __init__(self, missing: list[str], unexpected: list[str]) -> None:
        self.missing, self.unexpected = missing, unexpected
        parts = []
        if missing:
            parts.append(f"missing in the snapshot: {_some(missing)}")
        if unexpected:
            parts.append(f"in the snapshot but not in the target: {_some(unexpected)}")
        super().__init__("; ".join(parts) + " (strict=False loads the common keys)")


class ShapeMismatchError(StateError):
    """A tensor's global shape or dtype differs between the snapshot and the target."""


class NoSnapshotError(StateError):
    """No committed version of the job can be found."""


class UnrecoverableError(StateError):
    """Some boxes have no surviving copy, and no durable snapshot was given to fall back to."""

    def __init__(self, boxes: list[tuple[str, str]]) -> None:
        self.boxes = boxes
        names = sorted({t for t, _ in boxes})
        shown = ", ".join(f"{t} {b}" for t, b in boxes[:5])
        super().__init__(
            f"{len(boxes)} boxes of {len(names)} tensors have no surviving copy (e.g. {shown}); "
            "pass path= of a persisted snapshot to fall back to it"
        )


def _some(names: list[str], n: int = 8) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more
