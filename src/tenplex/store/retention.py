"""Which saves `retain` deletes: by commit order, never by step number, and never the newest complete save
(see docs/consistency.md)."""

from __future__ import annotations

from .versions import Version

Protect = tuple[int, str | None]  # (step, save id or None for whichever this store committed)
Lineage = list[tuple[int, Version]]  # (step, version) of one store's own saves, or of one peer's copies


def doomed_versions(lineage: Lineage, keep: int | None, protect: Protect | None) -> Lineage:
    """Which versions of one lineage (a store's own saves, or one peer's copies) `retain` deletes.

    The anchor is the protected save (the saver names it only once it committed on every store, so it is
    complete: marked so), else the newest save ever marked complete. Kept: the anchor, the newest
    `keep - 1` other commits by commit order (all of them for `keep=None`) and the newest complete one;
    an earlier save of the anchor's own step is superseded by it and goes.
    Steps are never compared: a rolled-back step commits after a larger one and is the newer. A store
    cannot tell a complete save from one whose commit reached it alone, so with no complete save known
    nothing committed is deleted. Uncommitted versions opened before the anchor are abandoned attempts
    and go; one opened after it may be a save in progress and stays."""
    done = sorted((v for _, v in lineage if v.committed), key=lambda v: v.order)
    anchor = None
    if protect is not None:
        for s, v in lineage:
            if s == protect[0] and v.committed and protect[1] in (None, v.save_id):
                anchor = v
                v.complete = True
    if anchor is None:
        anchor = next((v for v in reversed(done) if v.complete), None)
    if anchor is None:
        return []
    steps = {id(v): s for s, v in lineage}
    superseded = {id(v) for v in done if v is not anchor and steps[id(v)] == steps[id(anchor)]}
    others = [v for v in done if v is not anchor and id(v) not in superseded]
    newer = others if keep is None else others[len(others) - keep + 1 :]
    complete = [v for v in done if v.complete and id(v) not in superseded]
    kept = {id(v) for v in [anchor, *newer, *complete[-1:]]}
    return [(s, v) for s, v in lineage
            if (v.committed and id(v) not in kept) or (not v.committed and v.born < anchor.born)]  # fmt: skip
