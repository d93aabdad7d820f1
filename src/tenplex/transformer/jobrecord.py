"""A job's record of the stores its newest snapshot was committed on, each with its incarnation.

Why: when every store of a job restarted (a rebooted host, a redeployed cluster), the stores answer "no
snapshot" truthfully — for themselves. Only a record kept outside them says that the job had one, on which
stores, and so that starting over would throw it away. The committer writes it after every commit, on its
host; a load reads it only when no complete snapshot answers (`snapshot.choose`). One small JSON file per
job in $TENPLEX_STATE_DIR (`tenplex run`: the run directory), default `~/.tenplex/jobs`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..util import env

FORMAT = "tenplex.jobrecord"


@dataclass
class JobRecord:
    job: str
    step: int
    save_id: str | None
    stores: dict[str, str | None]  # store URL -> its incarnation when the save committed
    path: str = ""  # where the record was read from (for messages)


def directory() -> Path:
    return Path(env.get(env.STATE_DIR) or Path.home() / ".tenplex" / "jobs")


def _file(job: str) -> Path:
    return directory() / f"{job}.json"  # job names are [A-Za-z0-9._-]: never a path of their own


def write(manifest: dict[str, Any]) -> None:
    """Record a save committed on every store (written whole, then renamed: never read half-written).
    Best effort: a read-only home must not fail a save that committed."""
    data = {"format": FORMAT, "job": manifest["job"], "step": manifest["step"],
            "save_id": manifest.get("save_id"), "stores": manifest.get("incarnations", {})}  # fmt: skip
    target = _file(manifest["job"])
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".record-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, target)
    except OSError:
        pass


def read(job: str) -> JobRecord | None:
    """The job's record on this host; None when there is none (or it is not one: a record is evidence
    that stores are lost, never a reason to load anything)."""
    path = _file(job)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("job") != job:
        return None
    stores = data.get("stores")
    if not isinstance(stores, dict) or not isinstance(data.get("step"), int):
        return None
    stores = {str(k): v for k, v in stores.items()}
    return JobRecord(job, data["step"], data.get("save_id"), stores, str(path))


def forget(job: str) -> None:
    """Drop the record (the job was deleted on purpose, or started over with --fresh)."""
    try:
        _file(job).unlink()
    except OSError:
        pass
