"""JSON-lines records that workers and the controller append and read (one writer per file)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class Records:
    """Append-only JSON lines, flushed per record so a killed writer loses at most the line it was writing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = {"kind": kind, "time": time.time(), **fields}
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
