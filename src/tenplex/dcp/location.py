"""Where a DCP `checkpoint_id` lives in the stores: a job and a step, named by the path.

Code written for DCP's file system passes folders (`outputs/run-a/step-20`, a temporary folder). A folder
whose name ends in a number is that step of a job named by everything before the number; any other folder
is step 0 of a job named by the whole path. The job name keeps the path's readable tail and adds a digest
of the whole absolute path, so two runs' `.../step-20` folders are two jobs, and two different folders never
meet in one snapshot (the mapping is one to one: the path is its job's prefix followed by its step).
"""

from __future__ import annotations

import hashlib
import os
import re

from ..store.keys import MAX_STEP, check_job, check_step
from ..transformer.errors import StateError

_TAIL = re.compile(r"(.*?)(0|[1-9][0-9]{0,17})")  # path == prefix + str(step): one to one


def location(checkpoint_id: str | os.PathLike | int, job: str | None = None) -> tuple[str, int]:
    """The (job, step) of a checkpoint id: an int is a step of `job`; a path names both (module docstring)."""
    if isinstance(checkpoint_id, int):
        if job is None:
            raise StateError(f"checkpoint_id {checkpoint_id} is a step: name the job too")
        return check_job(job), check_step(checkpoint_id)
    path = os.fspath(checkpoint_id)
    if not isinstance(path, str) or not path:
        raise StateError(f"checkpoint_id {checkpoint_id!r} names no location")
    if "://" not in path:
        path = os.path.abspath(path)
    path = path.rstrip("/") or "/"
    m = _TAIL.fullmatch(path)
    if m is not None and int(m.group(2)) <= MAX_STEP:
        kind, base, step = "steps", m.group(1), int(m.group(2))
    else:
        kind, base, step = "folder", path, 0
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", base).strip("._-")[-80:].lstrip("._-") or "root"
    digest = hashlib.sha256(f"{kind}:{base}".encode()).hexdigest()[:16]
    return check_job(f"{readable}-{digest}"), step
