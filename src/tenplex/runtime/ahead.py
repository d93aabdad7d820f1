"""A phase started ahead: the next layout's ranks start while the current one still trains.

A planned change (a scale-out, a scale-in, a layout change, a redeploy at a step the schedule names) is
known before it comes. Its ranks can start as soon as the current phase trains: form their process
group, build the model, optimizer and data, and (the reference workload) rehearse one step, paying
DTensor's per-mesh caches and the first collectives; then they wait for their turn (`channel`). The
current phase's final save commits, its rank 0 gives the turn to the phase the controller named to it
(the controller does too, on the `done` record), and only the load and the first step are left of the
downtime. When the current phase ends otherwise (a failure, a crash), the controller cancels the phase
(`cancel`): its ranks end without loading anything, and the recovery starts as any other. Go and cancel
are one key written once (the first word wins), so a late go cannot undo a cancel or the other way round.

The controller plans the phase with the same steps it would take at the boundary, on a preview of the
allocation, and takes it only if the boundary's own plan is the same (`matches`); a phase told to go is
always taken (its ranks may have loaded already). Only where devices are CPUs: on an accelerator the new
ranks would need its memory while the old ones still hold theirs.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import takewhile
from typing import Any

from ..ptc.layout import Layout
from ..util import logs
from .channel import Channel
from .chooser import ChooserError
from .hosts import HostsError
from .phase import Phase
from .record_types import Ahead as AheadRecord
from .record_types import AheadSkipped
from .records import Kind
from .schedule import Event
from .standby import Role

log = logs.get("runtime")
CANCEL_WAIT_S = 10.0  # a cancelled phase's ranks end by themselves within this, else they are killed


@dataclass
class Ahead:
    phase: Phase  # started, its ranks waiting for their turn
    after: Phase  # the phase whose final save it starts from
    plan: tuple  # what it was started as: (layout, devices, start step, until, failures)
    channel: Channel

    def matches(self, plan: tuple) -> bool:
        return plan == self.plan

    @property
    def go_given(self) -> bool:
        """Whether the ranks were told to go: by `go`, or by the old phase's rank 0 right after its final
        commit (`name_go`); read once the old phase's ranks have ended, so it cannot change after."""
        return self.channel.went(self.phase.index)

    def name_go(self) -> None:
        """Tell the old phase's rank 0 whose turn it gives once its final save committed."""
        self.channel.name_next(self.phase.index, self.after.index)

    def go(self) -> None:
        """The state to start from is committed: the ranks load it and train (if rank 0 of the old phase
        has not said so already: the first word stays, with its time)."""
        self.channel.go(self.phase.index)

    def cancel(self, release: Callable[[Role], None]) -> bool:
        """The ranks end without loading (they wait for their turn, or reach the wait soon); those that do
        not within CANCEL_WAIT_S are killed; reusable processes go back to the pool (`release`). The
        phase's directory goes too, so its index and records belong to the phase that runs instead.
        False (and nothing done) when the ranks were told to go first: the phase runs."""
        if not self.channel.cancel(self.phase.index):
            return False
        deadline = time.monotonic() + CANCEL_WAIT_S
        for role in self.phase.procs:
            while role.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            if role.poll() is None:
                role.kill()
                role.wait()
            release(role)
        shutil.rmtree(self.phase.dir, ignore_errors=True)
        log.info("phase %d (started ahead) cancelled: phase %d ended otherwise", self.phase.index,
                 self.after.index)  # fmt: skip
        return True


class StartsAhead:
    """The controller's part in starting a phase ahead: whether the next phase is known (`_may_go_ahead`),
    starting it (`_go_ahead`), telling it to go on the old phase's `done` record, and taking it at the
    boundary (`_take`). The rest of the plan (layout, placement, spec, launch) is the controller's own."""

    _next: tuple[Phase, list[Event]] | None  # a phase whose successor may start ahead
    _ahead: Ahead | None  # that successor, once started
    cfg: Any  # the rest is the controller's (`runtime/controller.py`)
    end: int
    hosts: Any
    launcher: Any
    timeline: Any
    channel: Channel

    def _ahead_on_record(self, phase: Phase, r: dict) -> None:
        if r["kind"] == Kind.STEP and self._next is not None and self._next[0] is phase:
            self._ahead, self._next = self._go_ahead(*self._next), None
        if r["kind"] == Kind.DONE and self._ahead is not None and self._ahead.after is phase:
            self._ahead.go()

    def _may_go_ahead(self, phase: Phase, by_step: list[Event], by_time: list[Event]) -> bool:
        """Whether `phase` ends at a step the schedule names with a change (not a failure, not a time), so
        the next phase is known now; on CPUs only."""
        if not self.cfg.ahead or by_time or phase.failures or phase.until >= self.end:
            return False
        nxt = [e for e in by_step if e.step == phase.until]
        return bool(nxt) and not nxt[0].is_failure and self._on_cpus()

    def _go_ahead(self, current: Phase, by_step: list[Event]) -> Ahead | None:
        """Start the phase after `current` now, planned as the boundary would plan it (`_run`), on a
        preview of the allocation; None when that plan cannot be made now."""
        events = list(takewhile(lambda e: e.step <= current.until and not e.is_failure, by_step))
        rest = by_step[len(events) :]
        try:
            alloc = self.hosts.preview(events)
            layout = self._layout(len(alloc), events[-1].forced)
        except (HostsError, ChooserError):  # the boundary says so, in its own words
            return None
        until = min([self.end] + [e.step for e in rest if not e.is_failure])
        failures = [e.step for e in rest if e.is_failure and current.until <= e.step < until]
        devices = self._place(layout, alloc, current)
        phase = self._phase(current.index + 1, layout, devices, current.until, until, failures)
        plan = (layout, devices, phase.start_step, until, phase.failures)
        ahead = Ahead(phase, current, plan, self.channel)
        try:
            self.launcher.launch(phase, replace(self._spec(phase), ahead=True), self.cfg.script)
        except Exception as e:  # only an optimization: the boundary launches it (and says what fails)
            ahead.cancel(self.launcher.release)  # the ranks it did start
            self.timeline.write(AheadSkipped(phase.index, f"{type(e).__name__}: {e}"))
            log.warning("phase %d not started ahead: %s", phase.index, e)
            return None
        ahead.name_go()
        self.timeline.write(
            AheadRecord(phase.index, phase.label, devices, phase.start_step, current.last_step)
        )
        return ahead

    def _take(
        self,
        ahead: Ahead | None,
        layout: Layout | None,
        step: int,
        until: int,
        prev: Phase | None,
        failures: list[int],
    ) -> Phase | None:
        """The phase started ahead, if it is the one the boundary plans (always, once told to go: its ranks
        may have loaded); else it is cancelled and None returned."""
        if ahead is None:
            return None
        devices = self._place(layout, list(self.hosts.allocation), prev)
        due = sorted({ahead.phase.due(s) for s in failures if ahead.phase.due(s) < until})
        if not ahead.matches((layout, devices, step, until, due)):
            if not ahead.go_given and ahead.cancel(self.launcher.release):
                return None
            log.warning("phase %d (started ahead) differs from the plan; it runs", ahead.phase.index)
        self._announce(ahead.phase, prev, ahead=True)
        self._network()
        return ahead.phase
