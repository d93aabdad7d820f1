"""What an agent job's rounds recorded: each round's start, ready, steps, save and end (rank 0's
`worker.jsonl` in `out/roundN`), the steps trained, and the downtime of each change with its parts. The
agent tests, the schedule driver and `benchmarks/bench_agent.py` read a job through these."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

from .downtime import built_parts, saved_parts, turn_parts
from .records import Kind, read_records

PARTS = ("stop", "save", "rendezvous", "start", "process_group", "build", "load", "first_step", "other")


def rounds(out: Path) -> list[dict[str, Any]]:
    """Each round's records (rank 0's `worker.jsonl` in `out/roundN` under agents; under torchrun, one
    `out/worker.jsonl` whose starts begin with `fresh` or `loaded`): start, ready, steps, done."""
    dirs = sorted(out.glob("round*"), key=lambda p: int(p.name[5:]))
    if not dirs:
        return _split(records(out / "worker.jsonl"))
    return [dict(r, round=int(d.name[5:])) for d in dirs for r in _split(records(d / "worker.jsonl"))[:1]]


def records(path: Path) -> list[dict[str, Any]]:
    """A records file's records (none when it is not there yet)."""
    return read_records(path)[0] if path.exists() else []


def _split(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for rec in recs:
        # a start after the `settings` record opens no new round
        starts = rec["kind"] in (Kind.FRESH, Kind.LOADED)
        if not found or (starts and found[-1]["start"] is not None):
            found.append(
                {
                    "round": len(found) + 1,
                    "start": None,
                    "ready": None,
                    "saved": None,
                    "done": None,
                    "steps": [],
                }
            )
        r = found[-1]
        if rec["kind"] in (Kind.FRESH, Kind.LOADED):
            r["start"] = rec
        elif rec["kind"] in (Kind.READY, Kind.SAVED, Kind.DONE):
            r[rec["kind"]] = rec
        elif rec["kind"] == Kind.STEP:
            r["steps"].append(rec)
    return found


def step_now(out: Path) -> int:
    """The newest step any round trained (0 before the first)."""
    return max((s["step"] for r in rounds(out) for s in r["steps"]), default=0)


def trained(out: Path, world: int, since: float = 0.0) -> int:
    """Steps trained by rounds of this world size that started after `since`."""
    return sum(
        len(r["steps"])
        for r in rounds(out)
        if r["ready"] and r["ready"]["world"] == world and r["start"]["time"] > since
    )


def downtimes(out: Path, hosts_dir: Path | None = None) -> list[dict[str, Any]]:
    """Per change: from the old round's last step record to the new round's first, less one step's
    time (a step's record is written when it ends; `typical_step`): the downtime as the job saw it. With
    `hosts_dir` (the directory of the job's agents' run directories, whose records say when each round
    formed: the last of its agents to), its parts too (`round_parts`)."""
    rs = [r for r in rounds(out) if r["steps"]]
    formed: dict[int, float] = {}
    for f in sorted(hosts_dir.glob("*/agent.jsonl")) if hosts_dir is not None else []:
        for r in read_records(f)[0]:
            if r["kind"] == Kind.ROUND:
                formed[r["round"]] = max(r["time"], formed.get(r["round"], r["time"]))
    found = []
    for a, b in pairwise(rs):
        step = typical_step([s["time"] for s in b["steps"]])
        gap = b["steps"][0]["time"] - a["steps"][-1]["time"] - step
        found.append(
            {
                "round": b["round"],
                "world": b["ready"]["world"],
                "downtime": gap,
                "last_step": a["steps"][-1]["time"],
                "loaded": b["start"],
            }
        )
        if hosts_dir is not None:
            found[-1]["parts"] = round_parts(a, b, formed.get(b["round"]), step, gap)
    return found


def typical_step(times: list[float]) -> float:
    """A phase's step time from its step records' times: the median interval (one slow step, a snapshot's
    stall or a rehearsed layout's first real step, does not count), 0 with fewer than two."""
    gaps = sorted(b - a for a, b in pairwise(times))
    return gaps[len(gaps) // 2] if gaps else 0.0


def round_parts(
    a: dict[str, Any], b: dict[str, Any], formed: float | None, step: float, gap: float
) -> dict[str, float]:
    """A change's downtime (`gap`) in parts, from the rounds' records and when the new round formed:
    stop and save (the old round's final save; none after a failure), rendezvous (from that save, or the
    last step, until the new round formed: torch's rendezvous and, after a loss, its detection), start
    (the agent parking and handing the round, the script's start-up), then process_group, build, load and
    first_step (its time beyond a step's, `step`) as `tenplex run`'s `runtime/downtime.py` has them. A
    round handed ahead (built while the old one trained) starts at its turn: what it still built after
    is build."""
    since = a["steps"][-1]["time"]
    stop, save, saved_at = saved_parts(a["saved"], since)
    ready = b["ready"]
    init_at = ready.get("init_at", ready["time"])
    formed_at = formed if formed is not None else saved_at
    parts = {
        "stop": stop,
        "save": save,
        "rendezvous": max(0.0, formed_at - saved_at),
        "start": init_at - max(formed_at, saved_at),
        **built_parts(ready, ready.get("load_seconds", 0.0)),
        "first_step": b["steps"][0]["time"] - ready["time"] - step,
    }
    if ready.get("ahead"):  # built while the old round trained: the restart began at the turn
        start, build = turn_parts(ready, max(formed_at, saved_at), ready.get("load_seconds", 0.0))
        parts.update(start=start, process_group=0.0, build=build)
    parts["other"] = gap - sum(parts.values())
    assert tuple(parts) == PARTS
    return parts
