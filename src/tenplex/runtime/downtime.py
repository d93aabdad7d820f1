"""Downtime accounting: what one reconfiguration cost, from the ranks' records of the two phases."""

from __future__ import annotations

from typing import Any

from .hosts import host_of
from .phase import Phase


def _first(phase: Phase, kind: str) -> dict | None:
    return next((r for r in phase.records if r["kind"] == kind), None)


def reconfiguration(prev: Phase | None, phase: Phase) -> dict[str, Any] | None:
    """The change from `prev` to `phase` once the new ranks are ready: downtime (from the old phase's last
    step, or its failure, to the new ranks ready to train), save and load seconds, bytes moved against the
    plan; None for the first phase or before the new ranks are ready."""
    ready, loaded = _first(phase, "ready"), _first(phase, "loaded")
    if prev is None or ready is None:
        return None
    last_steps = [r for r in prev.records if r["kind"] == "step"]
    saved = _first(prev, "saved")
    since = (
        prev.failed_at
        if prev.failed_at is not None
        else (last_steps[-1]["time"] if last_steps else prev.launched)
    )
    return {
        "from": prev.label,
        "to": phase.label,
        "step": phase.start_step,
        "failure": prev.failed_at is not None,
        "downtime": ready["time"] - since,
        "save_seconds": saved["seconds"] if saved else None,
        "load_seconds": loaded["seconds"] if loaded else None,
        "build_seconds": ready.get("build_seconds"),
        "bytes": loaded["bytes"] if loaded else {},
        "plan": loaded["plan"] if loaded else {},
        "source": loaded["source"] if loaded else "none",
        "redeploy": not ({host_of(d) for d in prev.devices} & {host_of(d) for d in phase.devices}),
    }
