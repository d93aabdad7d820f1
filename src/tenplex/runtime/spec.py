"""The worker spec: everything one rank of an elastic job needs, the one value that crosses processes.

The controller (one file per phase) and the torchrun entry build it; the reference rank, `ElasticJob` and
the standby pool read it. A rank's own placement (its store, its device id, the stores a snapshot may be
in) differs per rank and comes from the environment: `WorkerSpec.from_env` is the one place a rank reads
the `TENPLEX_*` variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..ptc import TenplexError
from ..ptc.layout import Layout
from ..util import env as tenv
from ..util.env import DEVICE, EMULATED_HOSTS, JOB, SOURCES, SPEC, STORE

OPEN_END = 2**31 - 1  # a phase's `until` when the run named no step count: the script's own ends it


class SpecError(TenplexError):
    """A spec file that is missing, unreadable or not a spec."""


@dataclass
class WorkerSpec:
    job: str
    until: int  # the step this phase stops at (OPEN_END: at the script's own step count)
    # None: the script's own `ElasticJob(until=..., snapshot_every=...)`; set: the command line's, which win
    steps: int | None = None
    snapshot_every: int | None = 0
    out: str | None = None  # where records go (worker.jsonl, ledgers)
    stop_file: str | None = None  # stop (and save) at the next step once it exists (torchrun: --stop-file)
    control: str | None = None  # host:port of the runtime's store: its signals to the ranks (`channel`)
    phase: int = 0  # this phase's number there
    durable: str | None = None  # a persisted DCP snapshot to fall back to
    layout: Layout | None = None  # None: the rank chooses for its WORLD_SIZE (torchrun) or lays itself out
    train: dict[str, Any] | None = None  # the reference workload's TrainConfig (None for a user's script)
    table: dict | None = None  # para-config (devices -> layout) for that choice
    min_step_seconds: float = 0.0  # pace steps: emulates slower devices (tests, demos)
    # steps at which the schedule injects a failure in this phase: the ranks wait after each until it has
    # hit (`RankChannel.await_fired`), so it lands at that step however fast they train
    failures: list[int] = field(default_factory=list)
    # started ahead, while the phase before still trains: the ranks build, then wait for their turn (that
    # phase's final save committed) or a cancel (it ended otherwise) before they load anything
    ahead: bool = False
    fresh: bool = False  # start over even when stores that may hold a snapshot are lost (`run --fresh`)
    # this rank's placement, from the environment (not in the file: one file serves every rank of a phase)
    store: str | None = field(default=None, metadata={"env": True})
    device: str | None = field(default=None, metadata={"env": True})
    sources: list[str] = field(default_factory=list, metadata={"env": True})
    emulated_hosts: bool = field(default=False, metadata={"env": True})

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("env")}
        d["layout"] = self.layout.to_dict() if self.layout else None
        return d

    def to_file(self, path: str | Path) -> Path:
        """Written whole, then renamed: a rank never reads half of it."""
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.rename(p)
        return p

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkerSpec:
        known = {f.name for f in fields(cls) if not f.metadata.get("env")}
        unknown = set(d) - known
        if unknown or "job" not in d or "until" not in d:
            raise SpecError(f"not a worker spec: unknown keys {sorted(unknown)}, or no job and until")
        kw = dict(d)
        kw["layout"] = Layout.from_dict(d["layout"]) if d.get("layout") else None
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str | Path) -> WorkerSpec:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SpecError(f"cannot read the worker spec {str(path)!r}: {e}") from None
        if not isinstance(data, dict):
            raise SpecError(f"the worker spec {str(path)!r} is not a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerSpec | None:
        """This rank's spec: the phase's file ($TENPLEX_WORKER_SPEC) with its placement; None without one."""
        path = tenv.get(SPEC, environ)
        return None if path is None else cls.from_file(path).placed(environ)

    def placed(self, environ: Mapping[str, str] | None = None) -> WorkerSpec:
        """This spec with the rank's placement from the environment (for a spec built from flags too)."""
        self.store = tenv.get(STORE, environ) or self.store
        self.device = tenv.get(DEVICE, environ) or self.device
        self.sources = tenv.url_list(SOURCES, environ) or self.sources
        self.emulated_hosts = tenv.flag(EMULATED_HOSTS, environ) or self.emulated_hosts
        return self

    def rank_env(self, path: Path) -> dict[str, str]:
        """The variables that hand this spec and its placement to a rank process."""
        env = {SPEC: str(path), JOB: self.job}
        if self.store:
            env[STORE] = self.store
        if self.device:
            env[DEVICE] = self.device
        if self.sources:
            env[SOURCES] = ",".join(self.sources)
        if self.emulated_hosts:
            env[EMULATED_HOSTS] = "1"
        return env


def job_name(environ: Mapping[str, str] | None = None) -> str | None:
    """$TENPLEX_JOB: a script run without a spec may still be named from outside."""
    return tenv.get(JOB, environ)
