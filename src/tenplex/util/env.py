"""The one place library code reads `TENPLEX_*` environment variables.

`tenplex run`, torchrun entries and users set these to place a rank (its store, device id, the stores a
snapshot may be in) without changing the script; every layer asks here instead of reading `os.environ`
itself, so the variables a process honours are listed once. Read at call time (a test or a standby
process may set them after import).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SPEC = "TENPLEX_WORKER_SPEC"  # path of the phase's worker spec file
JOB = "TENPLEX_JOB"  # the job's name
STORE = "TENPLEX_STORE"  # this rank's store (its host's), a URL
STORE_TOKEN = "TENPLEX_STORE_TOKEN"  # the token clients prove they hold (default: this user's token file)
DEVICE = "TENPLEX_DEVICE"  # this rank's stable device id
SOURCES = "TENPLEX_SOURCES"  # every store a snapshot may be in, comma-separated
LOST = "TENPLEX_LOST_STORES"  # stores the runtime knows are gone (host died, or left): counted lost unasked
DURABLE = "TENPLEX_DURABLE"  # a directory of persisted checkpoints (step-N) to fall back to
EMULATED_HOSTS = "TENPLEX_EMULATED_HOSTS"  # "1": other emulated hosts' stores are reached over sockets
STATE_DIR = "TENPLEX_STATE_DIR"  # where a job's record of its stores lives (default ~/.tenplex/jobs)
FRESH = "TENPLEX_FRESH"  # "1": a job whose stores are lost may start over from step 0
CACHE = "TENPLEX_CACHE"  # where prepared corpora are cached
CALIBRATION = "TENPLEX_CALIBRATION"  # the chooser's benchmark rows, instead of the packaged ones
LAYOUT = "TENPLEX_LAYOUT"  # the layout asked for (dp=2,tp=2,pp=1): taken by a world it fits (agents)
CHOOSES = "TENPLEX_CHOOSES"  # "1": rank processes choose their layout (an agent's): the chooser preloaded


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value; None when unset or empty."""
    return (os.environ if environ is None else environ).get(name) or None


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    return get(name, environ) == "1"


def url_list(name: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """A comma-separated list (SOURCES), empty items dropped."""
    return [s for s in (get(name, environ) or "").split(",") if s]


def local_rank(default: int) -> int:
    """torchrun's LOCAL_RANK (not a tenplex variable, but read here for the same reason)."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value else default
