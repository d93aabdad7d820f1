"""Following a phase: the ranks' records into the timeline and the live view, the schedule's failures
injected at their steps, ranks that crash on their own, and finished ranks' processes reaped."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..util import logs
from .channel import Channel
from .hosts import EmulatedHosts, host_of
from .launcher import Launcher
from .live import LiveView
from .phase import Phase
from .record_types import Crash, Fail, FailSkipped, Heal, Partition, PartitionDetected, Worker
from .records import Kind, Records, read_records
from .schedule import Event
from .standby import Role

log = logs.get("runtime")
# the survivors of a failure get this long to notice their peers are gone (and a commit in flight to end)
# before they are killed: their collectives are broken, they cannot go on. Part of a failure's downtime.
KILL_AFTER_FAILURE_S = 0.5
POLL_S = 0.05  # how often the ranks' records and exit codes are looked at
PROBE_EVERY_S = 0.5  # how often a cut-off host's store is asked whether it answers


class Monitor:
    def __init__(
        self,
        timeline: Records,
        live: LiveView,
        hosts: EmulatedHosts,
        launcher: Launcher,
        channel: Channel,
        on_record: Callable[[Phase, dict], None],
    ) -> None:
        self.timeline, self.live, self.hosts, self.launcher = timeline, live, hosts, launcher
        self.channel = channel
        self.on_record = on_record
        self.exiting: list[tuple[Role, float]] = []  # finished phases' ranks tearing down, since
        self.cut: dict[str, float] = {}  # partitioned hosts not yet detected, since
        self._probed = 0.0

    def watch(self, phase: Phase, by_step: list[Event], stop_at: float | None, overlap_exit: bool) -> None:
        """Follow the ranks until they exit; fire the failures of `by_step` due in this phase (and take them
        off it); touch the stop file at time `stop_at`. With `overlap_exit`, a phase whose state is
        committed is left while its processes tear down."""
        fails = [e for e in by_step if e.is_failure and phase.start_step <= e.step < phase.until]
        while not self._look(phase, fails, by_step, stop_at, overlap_exit):
            time.sleep(POLL_S)
        phase.ended = time.time()
        self.take_records(phase)  # what the ranks wrote just before exiting
        if phase.failed_at is None and any(p.poll() not in (None, 0) for p in phase.procs):
            self.crashed(phase)  # every rank ended before a poll saw one of them die
        for i, role in enumerate(phase.procs):
            if i not in phase.detached:
                self.launcher.release(role)  # ranks that ended well take ranks of the next phase
        self.reap()
        if phase.detached:
            self.heal(phase)

    def _look(
        self, phase: Phase, fails: list[Event], by_step: list[Event], stop_at: float | None, overlap: bool
    ) -> bool:
        """One look at the phase's ranks, acting on what it shows: True once the phase is over (with
        `overlap_exit`: once its state is committed)."""
        self.take_records(phase)
        for e in list(fails):
            if phase.trained and phase.last_step >= e.step and phase.failed_at is None:
                fails.remove(e)
                by_step.remove(e)
                self.fail(phase, e)
                self.fired(phase)
        if stop_at is not None and time.time() >= stop_at:
            self.channel.stop(phase.index)
        if self.cut and phase.failed_at is None and time.time() - self._probed > PROBE_EVERY_S:
            self.detect(phase)
        codes = [p.poll() for i, p in enumerate(phase.procs) if i not in phase.detached]
        if all(c is not None for c in codes):
            return True
        if phase.done and phase.failed_at is None and overlap:
            # the state is committed: the next phase starts while these ranks tear down
            self.exiting += [(p, time.time()) for p in phase.procs if p.poll() is None]
            return True
        if phase.failed_at is None and any(c not in (None, 0) for c in codes):
            self.crashed(phase)  # a rank died on its own: the rest cannot go on
        if phase.failed_at is not None and time.time() - phase.failed_at > KILL_AFTER_FAILURE_S:
            for i, p in enumerate(phase.procs):
                if p.poll() is None and i not in phase.detached:
                    p.kill()
        return False

    def take_records(self, phase: Phase) -> None:
        """New records of the ranks: into the phase, the timeline and the live view."""
        new, phase.offset = read_records(phase.dir / "worker.jsonl", phase.offset)
        for r in new:
            phase.add(r)
            into_timeline(self.timeline, phase.index, r)
            self.live.record(r, phase.label)
            self.on_record(phase, r)

    def fired(self, phase: Phase) -> None:
        """Let the ranks waiting at a failure's step go on: the killed ones are gone, the rest find out."""
        for s in phase.failures:
            if s <= phase.last_step:
                self.channel.fire(phase.index, s)

    def crashed(self, phase: Phase) -> None:
        phase.failed_at = time.time()
        phase.killed = [i for i, p in enumerate(phase.procs) if p.poll() not in (None, 0)]
        phase.crashed = True
        self.timeline.write(Crash(phase.index, phase.killed, phase.last_step))
        log.warning("phase %d: ranks %s crashed at step %d", phase.index, phase.killed, phase.last_step)

    def fail(self, phase: Phase, e: Event) -> None:
        """Inject the failure `e`: kill its ranks, and its hosts with their stores (or cut hosts off)."""
        if e.partition:
            self.partition(phase, e)
            return
        ranks = [r for r in e.fail if r < len(phase.procs)]
        hosts = set(e.fail_hosts) & {host_of(d) for d in phase.devices}
        ranks += [r for r, d in enumerate(phase.devices) if host_of(d) in hosts and r not in ranks]
        if not ranks:
            self.timeline.write(FailSkipped(phase.index, e.describe()))
            self.live.note(f"{e.describe()}: no such rank or host in the running job, nothing to kill")
            return
        for r in ranks:
            phase.procs[r].kill()
        for h in hosts:
            self.hosts.kill_host(h)
        phase.killed, phase.failed_at = ranks, time.time()
        devices = [phase.devices[r] for r in ranks]
        self.timeline.write(Fail(phase.index, phase.last_step, ranks, sorted(hosts), devices))
        self.live.note(
            f"FAILURE at step {phase.last_step}: killed ranks {ranks}"
            + (f" and hosts {sorted(hosts)}" if hosts else "")
        )

    def partition(self, phase: Phase, e: Event) -> None:
        """Cut the event's hosts off (namespace hosts only); nothing is killed, the job has to notice."""
        hosts = sorted(set(e.partition) & {host_of(d) for d in phase.devices})
        if not hosts or not hasattr(self.hosts, "partition"):
            why = "no such host in the running job" if hosts == [] else "needs --network netns"
            self.timeline.write(FailSkipped(phase.index, e.describe(), why))
            self.live.note(f"{e.describe()}: {why}, nothing cut off")
            return
        for h in hosts:
            self.hosts.partition(h)
            self.cut[h] = time.time()
        self.timeline.write(Partition(phase.index, phase.last_step, hosts))
        self.live.note(f"PARTITION at step {phase.last_step}: {', '.join(hosts)} cut off")

    def detect(self, phase: Phase) -> None:
        """Hosts whose store stopped answering are dropped; their ranks are left running, the others
        (stuck in collectives with them) are stopped and the job recovers without those hosts."""
        self._probed = time.time()
        lost = self.hosts.unreachable(set(self.cut))
        if not lost:
            return
        ranks = [r for r, d in enumerate(phase.devices) if host_of(d) in lost]
        for h in sorted(lost):
            self.hosts.drop_host(h)
        phase.detached = ranks
        phase.killed, phase.failed_at = ranks, time.time()
        seconds = {h: round(time.time() - self.cut.pop(h), 2) for h in sorted(lost)}
        self.timeline.write(PartitionDetected(phase.index, phase.last_step, sorted(lost), ranks, seconds))
        self.live.note(f"lost contact with {', '.join(sorted(lost))} after {max(seconds.values()):.1f} s")

    def heal(self, phase: Phase) -> None:
        """The job went on without the cut-off hosts: their links come back, their ranks find their peers
        gone, and their stores are told to replicate nowhere."""
        for h in sorted({host_of(phase.devices[r]) for r in phase.detached}):
            self.hosts.heal(h)
        self.timeline.write(Heal(phase.index, phase.detached))

    def reap(self, grace: float = 10.0, wait: bool = False) -> None:
        """Forget exited ranks of earlier phases; kill those still tearing down after `grace` seconds."""
        for p, since in self.exiting:
            left = since + grace - time.time()
            if wait and left > 0:
                try:
                    p.wait(left)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None and time.time() > since + grace:
                p.kill()
                p.wait()
        self.exiting = [(p, since) for p, since in self.exiting if p.poll() is None]


def catch_up(timeline: Records, run_dir: Path, phases: int) -> int:
    """What the ranks of a killed controller's phases recorded after it stopped reading (the steps and
    the final save of a phase that ended as it was killed): into the timeline, before any record of this
    run's own, so the summary counts every step trained. The timeline holds each phase's records in file
    order, so those past its count are the missing ones. Returns how many were added."""
    recs = read_records(run_dir / "timeline.jsonl")[0]
    seen = Counter(r["phase"] for r in recs if r["kind"] == Kind.WORKER)
    added = 0
    for index in range(phases):
        recs, _ = read_records(run_dir / f"phase{index}" / "worker.jsonl")
        for r in recs[seen[index] :]:
            into_timeline(timeline, index, r)
            added += 1
    return added


def into_timeline(timeline: Records, index: int, r: dict) -> None:
    """A rank's record `r` of phase `index`, as the timeline keeps it."""
    timeline.write(
        Worker(index, r["kind"], r["time"]), **{k: v for k, v in r.items() if k not in ("time", "kind")}
    )
