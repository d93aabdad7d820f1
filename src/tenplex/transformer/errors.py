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

    def __reduce__(self) -> tuple:  # rank 0 plans a load and hands its errors to every rank, pickled
        return (type(self), (self.missing, self.unexpected))


class ShapeMismatchError(StateError):
    """A tensor's global shape or dtype differs between the snapshot and the target."""


class GroupError(TenplexError):
    """A collective of a save's or load's process group failed: a rank died, or the group timed out. Not
    the stores' fault: no fallback hides it, and nothing was written to the targets before it."""


class SaveTimeoutError(StateError, TimeoutError):
    """`SaveHandle.wait(timeout)` ran out while the commit was still under way."""


class NoSnapshotError(StateError):
    """No committed version of the job can be found."""


class StoresLostError(StateError):
    """No complete snapshot on the stores that answer, while stores that may hold one cannot answer
    (unreachable, unproven, or restarted since): never a reason to start the job over."""

    def __init__(self, job: str, lost: dict[str, str]) -> None:
        self.job, self.lost = job, dict(lost)
        shown = "; ".join(f"{u} ({why})" for u, why in sorted(lost.items())[:4])
        more = f"; and {len(lost) - 4} more" if len(lost) > 4 else ""
        super().__init__(
            f"job {job!r}: no complete snapshot in the stores that answer, and {len(lost)} store(s) that may "
            f"hold one are lost: {shown}{more}. Bring them back or load a persisted snapshot (path=); to "
            "start over from step 0 anyway, pass --fresh (TENPLEX_FRESH=1)"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.job, self.lost))


class CheckpointExistsError(StateError, RuntimeError):
    """The step a save names is committed and the writer was told not to overwrite it (DCP raises a
    RuntimeError there too)."""


class DurableError(StateError):
    """A persisted (DCP) snapshot could not be written or read whole; nothing was written to the targets."""


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

    def __reduce__(self) -> tuple:
        return (type(self), (self.boxes,))


def _some(names: list[str], n: int = 8) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more
