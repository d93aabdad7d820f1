"""One phase of an elastic job: one layout on one set of devices, one process group, until its last step."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..ptc.layout import Layout
from .placement import Placed
from .records import Kind
from .standby import Role


@dataclass
class Phase:
    index: int
    layout: Layout | None  # None: a script that lays itself out
    devices: list[str]
    start_step: int
    until: int
    failures: list[int] = field(default_factory=list)  # steps the ranks wait at for an injected failure
    procs: list[Role] = field(default_factory=list)
    dir: Path = Path()
    launched: float = 0.0
    records: list[dict] = field(default_factory=list)
    offset: int = 0
    killed: list[int] = field(default_factory=list)
    detached: list[int] = field(default_factory=list)  # ranks on a cut-off host: left running, not waited for
    failed_at: float | None = None
    last_step: int = -1  # the newest step the ranks reported (loaded, or trained)
    trained: bool = False  # whether a step was trained in this phase
    crashed: bool = False  # a rank died on its own (not a failure the schedule injected)
    done: bool = False  # rank 0 reported the final save committed: the next phase may start
    reported: str | None = None  # the layout the ranks say they run (a script's own name for it)
    ended: float = 0.0  # when the controller saw the ranks end (or leave, their state committed)
    persist_seconds: float = 0.0  # the DCP snapshot the controller wrote after it, before the next phase

    def __post_init__(self) -> None:
        self.last_step = max(self.last_step, self.start_step)

    def due(self, step: int) -> int:
        """The step at which a failure the schedule puts at `step` hits this phase: after its first trained
        step at the earliest (the monitor fires once a step was trained)."""
        return max(step, self.start_step + 1)

    @property
    def label(self) -> str:
        """What this phase runs, for the live view, the table, the summary and the plot."""
        return self.reported or (str(self.layout) if self.layout else f"world{len(self.devices)}")

    @property
    def placed(self) -> Placed | None:
        return Placed(self.layout, tuple(self.devices)) if self.layout else None

    def add(self, r: dict) -> None:
        self.records.append(r)
        if r["kind"] in (Kind.LOADED, Kind.FRESH):  # where the ranks start: before `start_step` when
            self.last_step = r["step"]  # the snapshot the controller counted on could not be read (or none)
        elif r["kind"] == Kind.STEP:
            self.last_step = max(self.last_step, r["step"])
        if r["kind"] == Kind.READY and r.get("layout"):
            self.reported = r["layout"]
        self.trained = self.trained or r["kind"] == Kind.STEP
        self.done = self.done or r["kind"] == Kind.DONE
