"""What a run's timeline says happened: the loss of each step and each change of layout, named in the words
the report's table, the plot and the README share.

Kinds: `scale out` and `scale in` (more or fewer devices), `layout change` (as many devices, another layout),
`redeploy` (onto hosts disjoint from the old ones) and `failure` (ranks died or hosts were lost: the change
is the recovery, which resumes from a snapshot before the step they died at).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .records import Kind, read_records

KINDS = ("scale out", "scale in", "layout change", "redeploy", "failure")
# the controller's records of ranks lost, at their step
DEATHS = (Kind.FAIL, Kind.CRASH, Kind.PARTITION_DETECTED)


def timeline(run_dir: Path) -> list[dict[str, Any]]:
    return read_records(run_dir / "timeline.jsonl")[0]


def losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """Loss per step; a step run again after a failure keeps its last value."""
    out: dict[int, float] = {}
    for r in records:
        if r["kind"] == Kind.WORKER and r["event"] == Kind.STEP:
            out[r["step"]] = r["loss"]
    return dict(sorted(out.items()))


def kind_of(r: dict[str, Any], devices: tuple[int, int]) -> str:
    """The kind of the change `r` (a `reconfig` record) from `devices[0]` to `devices[1]` devices."""
    if r["failure"]:
        return "failure"
    if r["redeploy"]:
        return "redeploy"
    a, b = devices
    return "scale out" if b > a else "scale in" if b < a else "layout change"


def change_name(kind: str, devices: tuple[int, int]) -> str:
    """What the table, the plot and the live view call a change: "scale out 2 → 4", "redeploy"."""
    return f"{kind} {devices[0]} → {devices[1]}" if kind in ("scale out", "scale in") else kind


def changes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `reconfig` records, each with its kind (`change_kind`), what the table and the plot call it
    (`change`: "scale out 2 → 4"), the devices and hosts before and after (from the two phases' launches:
    a change is recorded in its new phase, after that phase's launch) and, for a failure, the step the
    controller saw its ranks lost at (`died`; the recovery resumes from a snapshot before it) and which
    ranks (`lost`)."""
    out: list[dict[str, Any]] = []
    launches: list[dict[str, Any]] = []
    death: dict[str, Any] = {}
    for r in records:
        if r["kind"] == Kind.LAUNCH:
            launches.append(r)
        elif r["kind"] in DEATHS:
            death = r
        elif r["kind"] == Kind.RECONFIG:
            old, new = launches[-2:] if len(launches) >= 2 else ({}, {})  # a timeline cut short: no counts
            devices = (len(old.get("devices", [])), len(new.get("devices", [])))
            kind = kind_of(r, devices)
            death = death if r["failure"] else {}
            out.append({
                **r,
                "change_kind": kind,
                "change": change_name(kind, devices),
                "devices": list(devices),
                "hosts": [old.get("hosts", []), new.get("hosts", [])],
                "died": death.get("step"),
                "lost": death.get("ranks"),
            })  # fmt: skip
            death = {}
    return out
