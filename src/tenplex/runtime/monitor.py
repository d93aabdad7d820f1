"""Following a phase: the ranks' records into the timeline and the live view, the schedule's failures
injected at their steps, ranks that crash on their own, and finished ranks' processes reaped."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

from ..util import logs
from .hosts import EmulatedHosts, host_of
from .launcher import Launcher
from .live import LiveView
from .phase import Phase
from .records import Records, read_records
from .schedule import Event
from .standby import Role

log = logs.get("runtime")
# the survivors of a failure get this long to notice their peers are gone (and a commit in flight to end)
# before they are killed: their collectives are broken, they cannot go on. Part of a failure's downtime.
KILL_AFTER_FAILURE_S = 0.5
POLL_S = 0.05  # how often the ranks' records and exit codes are looked at


class Monitor:
    def __init__(
        self,
        timeline: Records,
        live: LiveView,
        hosts: EmulatedHosts,
        launcher: Launcher,
        on_record: Callable[[Phase, dict], None],
    ) -> None:
        self.timeline, self.live, self.hosts, self.launcher = timeline, live, hosts, launcher
        self.on_record = on_record
        self.exiting: list[tuple[Role, float]] = []  # finished phases' ranks tearing down, since

    def watch(self, phase: Phase, by_step: list[Event], stop_at: float | None, overlap_exit: bool) -> None:
        """Follow the ranks until they exit; fire the failures of `by_step` due in this phase (and take them
        off it); touch the stop file at time `stop_at`. With `overlap_exit`, a phase whose state is
        committed is left while its processes tear down."""
        fails = [e for e in by_step if e.is_failure and phase.start_step <= e.step < phase.until]
        while True:
            self.take_records(phase)
            for e in list(fails):
                if phase.trained and phase.last_step >= e.step and phase.failed_at is None:
                    fails.remove(e)
                    by_step.remove(e)
                    self.fail(phase, e)
            if stop_at is not None and time.time() >= stop_at:
                (phase.dir / "stop").touch()
            codes = [p.poll() for p in phase.procs]
            if all(c is not None for c in codes):
                break
            if phase.done and phase.failed_at is None and overlap_exit:
                # the state is committed: the next phase starts while these ranks tear down
                self.exiting += [(p, time.time()) for p in phase.procs if p.poll() is None]
                break
            if phase.failed_at is None and any(c not in (None, 0) for c in codes):
                self.crashed(phase)  # a rank died on its own: the rest cannot go on
            if phase.failed_at is not None and time.time() - phase.failed_at > KILL_AFTER_FAILURE_S:
                for p in phase.procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(POLL_S)
        phase.ended = time.time()
        self.take_records(phase)  # what the ranks wrote just before exiting
        if phase.failed_at is None and any(p.poll() not in (None, 0) for p in phase.procs):
            self.crashed(phase)  # every rank ended before a poll saw one of them die
        for role in phase.procs:
            self.launcher.release(role)  # ranks that ended well take ranks of the next phase
        self.reap()

    def take_records(self, phase: Phase) -> None:
        """New records of the ranks: into the phase, the timeline and the live view."""
        new, phase.offset = read_records(phase.dir / "worker.jsonl", phase.offset)
        for r in new:
            phase.add(r)
            self.timeline.write(
                "worker",
                phase=phase.index,
                event=r["kind"],
                at=r["time"],
                **{k: v for k, v in r.items() if k not in ("time", "kind")},
            )
            self.live.record(r, phase.label)
            self.on_record(phase, r)

    def crashed(self, phase: Phase) -> None:
        phase.failed_at = time.time()
        phase.killed = [i for i, p in enumerate(phase.procs) if p.poll() not in (None, 0)]
        phase.crashed = True
        self.timeline.write("crash", phase=phase.index, ranks=phase.killed, step=phase.last_step)
        log.warning("phase %d: ranks %s crashed at step %d", phase.index, phase.killed, phase.last_step)

    def fail(self, phase: Phase, e: Event) -> None:
        """Inject the failure `e`: kill its ranks, and its hosts with their stores."""
        ranks = [r for r in e.fail if r < len(phase.procs)]
        hosts = set(e.fail_hosts) & {host_of(d) for d in phase.devices}
        ranks += [r for r, d in enumerate(phase.devices) if host_of(d) in hosts and r not in ranks]
        if not ranks:
            self.timeline.write("fail_skipped", phase=phase.index, event=e.describe())
            self.live.note(f"{e.describe()}: no such rank or host in the running job, nothing to kill")
            return
        for r in ranks:
            phase.procs[r].kill()
        for h in hosts:
            self.hosts.kill_host(h)
        phase.killed, phase.failed_at = ranks, time.time()
        self.timeline.write(
            "fail",
            phase=phase.index,
            step=phase.last_step,
            ranks=ranks,
            hosts=sorted(hosts),
            devices=[phase.devices[r] for r in ranks],
        )
        self.live.note(
            f"FAILURE at step {phase.last_step}: killed ranks {ranks}"
            + (f" and hosts {sorted(hosts)}" if hosts else "")
        )

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
