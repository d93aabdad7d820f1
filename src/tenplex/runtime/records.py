"""The runtime's records: each kind a dataclass (its fields declared once, in `record_types`), JSON lines that
the ranks, the controller and the agents append and read (one writer per file), serialized in one place
(`Records.write`).

Readers get the JSON objects back as dicts and compare `r["kind"]` with a `Kind` (a `StrEnum`: equal to its
string), so a misspelt kind fails where it is written, not as a record that silently never matches.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar


class Kind(StrEnum):
    # a rank's (rank 0 writes the phase's or round's worker.jsonl; every dp rank its ledger)
    SETTINGS = "settings"
    WAITING = "waiting"
    FRESH = "fresh"
    LOADED = "loaded"
    READY = "ready"
    STEP = "step"
    SNAPSHOT = "snapshot"
    UNREPLICATED = "unreplicated"
    STORE_FULL = "store_full"
    SAVED = "saved"
    SAVE_FAILED = "save_failed"
    DONE = "done"
    SAMPLES = "samples"
    # the controller's (timeline.jsonl)
    START = "start"
    RESUME = "resume"
    EVENT = "event"
    LAUNCH = "launch"
    AHEAD = "ahead"
    AHEAD_SKIPPED = "ahead_skipped"
    WORKER = "worker"  # a rank's record, as the timeline keeps it (its kind in `event`)
    FAIL = "fail"
    CRASH = "crash"
    FAIL_SKIPPED = "fail_skipped"
    PARTITION = "partition"
    PARTITION_DETECTED = "partition_detected"
    HEAL = "heal"
    RECOVER = "recover"
    RECONFIG = "reconfig"
    STORES_LOST = "stores_lost"
    SNAPSHOTS_SKIPPED = "snapshots_skipped"
    MATCH_SKIPPED = "match_skipped"
    PERSIST = "persist"
    PERSIST_FAILED = "persist_failed"
    NETWORK = "network"
    GIVE_UP = "give_up"
    FINISH = "finish"
    # an agent's (agent.jsonl)
    STORE = "store"
    WARM = "warm"
    ROUND = "round"
    CHANGE = "change"
    FOUND_LOST = "found_lost"
    WORKER_FAILED = "worker_failed"
    LEFT = "left"
    STANDBY = "standby"
    END = "end"


@dataclass(frozen=True)
class Record:
    """A record's declared fields; a field left at its default None is not written (absent, as before)."""

    kind: ClassVar[Kind]

    def as_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None or f.default is not None:
                out[f.name] = value
        return out


class Records:
    """Append-only JSON lines, flushed per record so a killed writer loses at most the line it was writing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: Record, **extra: Any) -> dict[str, Any]:
        """`record`, with the `extra` fields its kind leaves open (a step's metrics, a script's own)."""
        if not isinstance(record, Record):
            raise TypeError(f"a record is one of runtime/record_types.py's dataclasses, not {record!r}")
        rec = {"kind": str(record.kind), "time": time.time(), **record.as_dict(), **extra}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()
        return rec

    def close(self) -> None:
        self._f.close()


def read_records(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete records from byte `offset` on, and the offset after the last complete line."""
    p = Path(path)
    if not p.exists():
        return [], offset
    with open(p, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn line of a killed writer
    return out, offset + end
