"""What the ranks' records say that the user should hear of at once: snapshots passed over, stores lost, a
snapshot not copied to its replicas, a store full. Into the timeline and the live view."""

from __future__ import annotations

from ..util import logs
from .live import LiveView
from .phase import Phase
from .record_types import SnapshotsSkipped, StoresLost, Unreplicated
from .records import Kind, Records

log = logs.get("runtime")


def notice(timeline: Records, live: LiveView, phase: Phase, r: dict) -> None:
    if r["kind"] == Kind.LOADED and r.get("skipped"):
        _skipped(timeline, live, phase, r)
    if r["kind"] == Kind.LOADED and r.get("lost_stores"):
        why = r.get("lost_why") or {}
        timeline.write(StoresLost(why, phase=phase.index, step=r["step"]))
        live.note(f"phase {phase.index} loaded step {r['step']}; stores lost: {lost_line(why)}")
    if r["kind"] == Kind.UNREPLICATED:
        failed = {u: why for u, why in r["replication"].items() if why not in ("none", "done")}
        timeline.write(Unreplicated(r["step"], failed, phase=phase.index))
        copies = "; ".join(f"{u}: {why}" for u, why in sorted(failed.items()))
        live.note(f"the snapshot of step {r['step']} is committed but not copied to its replicas: {copies}")
    if r["kind"] == Kind.STORE_FULL:
        what = "skipped" if r["skipped"] else "tried again"
        log.warning("phase %d: the save of step %d did not fit: %s", phase.index, r["step"], r["error"])
        live.note(
            f"the snapshot of step {r['step']} did not fit in the stores ({what}); keeping "
            f"only the newest from now on: {r['error']}"
        )


def _skipped(timeline: Records, live: LiveView, phase: Phase, r: dict) -> None:
    """The ranks passed over newer snapshots they could not read (a flipped byte fails its checksum):
    said in the timeline and the live view, as the step they resumed from instead."""
    steps = [x["step"] for x in r["skipped"]]
    errors = [x["error"] for x in r["skipped"]]
    timeline.write(SnapshotsSkipped(phase.index, steps, r["step"], errors))
    log.warning("phase %d: snapshots %s could not be read: %s", phase.index, steps, r["skipped"][0])
    live.note(f"snapshots of steps {steps} could not be read; loaded step {r['step']} instead")


def lost_line(lost: dict[str, str]) -> str:
    """Lost stores and why, in one line: unreachable, unproven (not the store it was) or restarted."""
    return "; ".join(f"{u} {why.split(':', 1)[0]}" for u, why in sorted(lost.items())) or "none"
