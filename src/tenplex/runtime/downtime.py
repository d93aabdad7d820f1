"""Downtime accounting: what one reconfiguration cost, and where the time went, from the records of the two
phases (the ranks' and the controller's; one machine, one clock).

downtime = from the old phase's last step (or its failure) to the new phase's first step, in parts:
  stop           the old ranks agreeing to stop, and a snapshot in flight finishing
  save           the final save the new layout loads from
  go             a phase started ahead (built, and its first step rehearsed, while the old layout trained):
                 from that save's commit until its ranks were told to go (the go file written); then exit,
                 persist, start and process_group are not on the path (0) and build is what the ranks did
                 after the go (a rank still building when it came included)
  exit           the old ranks ending (barrier, teardown or return to the pool) until the controller sees it
  persist        the controller's DCP copy of that state (the durable tier), before the next phase
  start          the new ranks' processes taking their roles until the job object exists (a user script's
                 own start-up; the controller's layout choice and rank placement)
  process_group  torch.distributed's rendezvous
  build          the model, the optimizer and the data (everything before the load that is not the above)
  load           the state moved into the new layout
  first_step     the first training step (warm-up: first collectives, allocations)
  other          what the records do not cover (should be near zero)
"""

from __future__ import annotations

from typing import Any

from .hosts import host_of
from .phase import Phase
from .records import Kind

SHOWN_FROM_S = 0.005  # a part shorter than this in every change is folded into `other`
PARTS = ("stop", "save", "go", "exit", "persist", "start", "process_group", "build", "load", "first_step")


def shown_parts(reconfigs: list[dict[str, Any]]) -> list[str]:
    """The parts worth a column of the table or a colour of the plot: SHOWN_FROM_S or more in some change."""
    big = {p for r in reconfigs for p, v in r["parts"].items() if abs(v) >= SHOWN_FROM_S}
    order = dict.fromkeys(p for r in reconfigs for p in r["parts"])  # an agent job's parts are its own
    return [p for p in order if p in big]


def saved_parts(saved: dict | None, since: float) -> tuple[float, float, float]:
    """`stop` and `save` of the old layout's final save record (none after a failure: 0 and 0), and when
    that save ended (`since`, the last step or the failure, without one)."""
    if saved is None:
        return 0.0, 0.0, since
    return max(0.0, saved["time"] - saved["seconds"] - since), saved["seconds"], saved["time"]


def built_parts(ready: dict, load: float) -> dict[str, float]:
    """`process_group`, `build` and `load` of the new layout's ranks, from their `ready` record: from the
    job object's start (`init_at`) to ready, less the group and the load."""
    init_at, group = ready.get("init_at", ready["time"]), ready.get("process_group_seconds", 0.0)
    return {"process_group": group, "build": ready["time"] - init_at - group - load, "load": load}


def turn_parts(ready: dict, since: float, load: float) -> tuple[float, float]:
    """Ranks started ahead (built while the old layout trained): how long after `since` (the old layout's
    final save, or the new round formed) they were told to go, and what they still built after that."""
    go_at = max(ready["go_at"], since)  # (told before `since`: the go record is written right before it)
    return go_at - since, max(0.0, ready["time"] - go_at - load)


def _first(phase: Phase, kind: Kind) -> dict | None:
    return next((r for r in phase.records if r["kind"] == kind), None)


def breakdown(prev: Phase, phase: Phase) -> dict[str, float] | None:
    """Seconds per part of the change from `prev` to `phase` (see the module), or None until the new ranks
    trained a step (or ended without one)."""
    ready, loaded = _first(phase, Kind.READY), _first(phase, Kind.LOADED)
    end = _first(phase, Kind.STEP) or _first(phase, Kind.DONE)
    if ready is None or end is None:
        return None
    steps = [r for r in prev.records if r["kind"] == Kind.STEP]
    since = prev.failed_at if prev.failed_at is not None else (steps[-1]["time"] if steps else prev.launched)
    stop, save, saved_at = saved_parts(_first(prev, Kind.SAVED) if prev.failed_at is None else None, since)
    ended = max(prev.ended or saved_at, saved_at)
    init_at = ready.get("init_at", ready["time"])
    load = loaded["seconds"] if loaded else 0.0
    parts = {
        "stop": stop,
        "save": save,
        "go": 0.0,
        "exit": ended - saved_at,
        "persist": prev.persist_seconds,
        "start": init_at - ended - prev.persist_seconds,
        **built_parts(ready, load),
        "first_step": end["time"] - ready["time"] if end["kind"] == Kind.STEP else 0.0,
    }
    if ready.get("ahead"):  # built while the old layout trained: the restart began at the go
        go, build = turn_parts(ready, saved_at, load)
        parts.update(go=go, exit=0.0, persist=0.0, start=0.0, process_group=0.0, build=build)
    parts["other"] = (end["time"] - since) - sum(parts.values())
    return parts


def reconfiguration(prev: Phase | None, phase: Phase) -> dict[str, Any] | None:
    """The change from `prev` to `phase` once the new ranks trained their first step: downtime (the old
    phase's last step, or its failure, to that step) and its parts, save and load seconds, bytes moved
    against the plan; None for the first phase or before that step."""
    if prev is None:
        return None
    parts = breakdown(prev, phase)
    if parts is None:
        return None
    loaded, saved = _first(phase, Kind.LOADED), _first(prev, Kind.SAVED)
    return {
        "from": prev.label,
        "to": phase.label,
        "step": phase.start_step,
        "failure": prev.failed_at is not None,
        "downtime": sum(parts.values()),
        "parts": parts,
        "save_seconds": saved["seconds"] if saved and prev.failed_at is None else None,
        "load_seconds": loaded["seconds"] if loaded else None,
        "build_seconds": parts["build"],
        "bytes": loaded["bytes"] if loaded else {},
        "plan": loaded["plan"] if loaded else {},
        "source": loaded["source"] if loaded else "none",
        "redeploy": not ({host_of(d) for d in prev.devices} & {host_of(d) for d in phase.devices}),
        "devices": [len(prev.devices), len(phase.devices)],
    }
