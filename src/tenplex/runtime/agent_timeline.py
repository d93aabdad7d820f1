"""An agent job told in `tenplex run`'s words: its `timeline.jsonl`, which the report, the summary, the
plot and the data ledger read, built from what the job's agents (each host's `agent.jsonl`) and its
rounds' rank 0 (`roundN/worker.jsonl`) recorded. A round is a phase: its launch (devices in rank order,
hosts, layout), its ranks' records, and for each change the `reconfig` record with the downtime and its
parts (`round_records.downtimes`); a round that broke (no final save) is a failure: the ranks gone from
the next round, and the recovery from the step that round loaded.

Written once the job ended (the driver's `timeline`), from records that each have one writer, so it says
only what happened: nothing here is sent to the job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .hosts import host_of
from .record_types import Fail, Finish, Launch, Reconfig, Recover, Start, Worker
from .records import Kind, Records
from .round_records import downtimes, records, rounds

TIMELINE = "timeline.jsonl"


def placements(hosts_dir: Path) -> dict[int, list[str]]:
    """Round -> its devices (`h0/d1`) in rank order: each agent's round record says its node (hosts in
    node order) and its devices; a host is the directory its agent ran in."""
    found: dict[int, list[tuple[int, str, list[int]]]] = {}
    for f in sorted(hosts_dir.glob("*/agent.jsonl")):
        for r in records(f):
            if r["kind"] == Kind.ROUND:
                found.setdefault(r["round"], []).append((r["node"], f.parent.name, r["devices"]))
    return {n: [f"{h}/d{d}" for _, h, ds in sorted(v) for d in ds] for n, v in found.items()}


def _hosts(devices: list[str]) -> list[str]:
    return list(dict.fromkeys(host_of(d) for d in devices))


def write_timeline(out: Path, hosts_dir: Path, start: Start) -> list[dict[str, Any]]:
    """`out/timeline.jsonl` (replaced) for the job whose rounds wrote under `out` and whose agents ran in
    `hosts_dir`; its records."""
    placed = placements(hosts_dir)
    changes = {d["round"]: d for d in downtimes(out, hosts_dir)}
    (out / TIMELINE).unlink(missing_ok=True)
    timeline = Records(out / TIMELINE)
    written: list[dict[str, Any]] = []

    def put(record: Any, t: float, **extra: Any) -> None:
        written.append(timeline.write(record, time=t, **extra))

    rs = rounds(out)
    first = next((r for r in rs if r["start"]), None)
    put(start, first["start"]["time"] if first else 0.0)
    prev: dict[str, Any] | None = None
    for r in rs:
        if not r["ready"]:
            continue  # a round that never trained (it broke while it formed): the next one says it all
        n, devices = r["round"], placed.get(r["round"], [])
        if prev is not None and prev["saved"] is None and prev["steps"]:  # it broke: ranks gone or crashed
            old = placed.get(prev["round"], [])
            gone = [i for i, d in enumerate(old) if d not in devices]
            died = prev["steps"][-1]["step"]
            put(Fail(prev["round"], died, gone, [h for h in _hosts(old) if h not in _hosts(devices)],
                     [old[i] for i in gone]), prev["steps"][-1]["time"])  # fmt: skip
            put(Recover(r["start"]["step"], died - r["start"]["step"], devices), r["start"]["time"])
        steps = r["steps"]
        until = r["done"]["step"] if r["done"] else (steps[-1]["step"] if steps else r["start"]["step"])
        put(Launch(n, r["ready"]["layout"], devices, r["start"]["step"], until, _hosts(devices)),
            r["start"]["time"])  # fmt: skip
        for rec in (r["start"], r["ready"]):
            _worker(put, n, rec)
        if prev is not None and n in changes:
            put(Reconfig(), steps[0]["time"], **_reconfig(prev, r, changes[n], placed))
        for rec in [*steps, *(x for x in (r["saved"], r["done"]) if x)]:
            _worker(put, n, rec)
        prev = r if steps else prev  # a change is between rounds that trained (`downtimes`)
    if prev is not None:
        last = prev["steps"][-1] if prev["steps"] else prev["start"]
        put(Finish(last["step"], last["time"] - written[0]["time"], None), last["time"])
    timeline.close()
    return written


def _worker(put: Any, n: int, rec: dict[str, Any]) -> None:
    put(Worker(n, rec["kind"], rec["time"]), rec["time"],
        **{k: v for k, v in rec.items() if k not in ("time", "kind")})  # fmt: skip


def _reconfig(
    a: dict[str, Any], b: dict[str, Any], change: dict[str, Any], placed: dict[int, list[str]]
) -> dict[str, Any]:
    """The `reconfig` record's fields (`downtime.reconfiguration`'s) of the change from round `a` to `b`."""
    loaded = b["start"] if b["start"]["kind"] == Kind.LOADED else {}
    before, after = placed.get(a["round"], []), placed.get(b["round"], [])
    return {
        "from": a["ready"]["layout"],
        "to": b["ready"]["layout"],
        "step": b["start"]["step"],
        "failure": a["saved"] is None,
        "downtime": change["downtime"],
        "parts": change["parts"],
        "save_seconds": a["saved"]["seconds"] if a["saved"] else None,
        "load_seconds": loaded.get("seconds"),
        "build_seconds": change["parts"]["build"],
        "bytes": loaded.get("bytes", {}),
        "plan": loaded.get("plan", {}),
        "source": loaded.get("source", "none"),
        "redeploy": not set(_hosts(before)) & set(_hosts(after)),
        "devices": [len(before), len(after)],
    }
