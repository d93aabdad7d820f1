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
from dataclasses import dataclass

from ..util import logs
from .channel import Channel
from .phase import Phase
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
