"""A resource schedule (`runtime/schedule.py`) played on agents: one `tenplex agent` per emulated host
(`agent_hosts`), the job's devices taken and given back as the schedule says, each change at its step.

The devices are those `tenplex run` allocates (`hosts.allocate`: hosts h0, h1, ..., the same rule). A
planned event at step S becomes: the step asked for (`tenplex layout --at-step S`, with the event's layout
or `auto`), `tenplex devices --at-step S` for a host whose devices change, a new agent for a host that
joins, SIGTERM for one that leaves; the agents hold every one of these until the round trained S, then
form the next round, which loads S (an ask that comes after S was trained lands at the next step
boundary: `log` says where each landed). A failure is not planned: once the job trained step S, the host is
lost (agent, workers and store killed at once) or cut off (a partition, namespace hosts only), or the
ranks' devices fail (`tenplex devices --failed`: their workers killed at once), and the agents go on
without them from the newest snapshot. An event by time waits for its second since the start and lands
at the next step boundary.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ptc import TenplexError
from .agent_hosts import AgentJob
from .agent_timeline import placements, write_timeline
from .hosts import allocate, device_index, host_of
from .record_types import Start
from .round_records import rounds, step_now
from .rounds import AgentError
from .schedule import Event

END_WAIT_S = 10.0  # an agent that ended: the others of a job that ended follow within this


class DriverError(TenplexError):
    """A schedule the agents cannot play here (a partition without namespace hosts), or a host or rank
    it names that the job does not have."""


@dataclass
class Pool:
    """The emulated hosts the job may take devices from (`hosts.Pool`)."""

    devices_per_host: int
    max_hosts: int = 16
    failed_devices: set[str] = field(default_factory=set)
    failed_hosts: set[str] = field(default_factory=set)


def by_host(devices: list[str]) -> dict[str, list[int]]:
    """`["h0/d0", "h0/d1", "h1/d0"]` -> `{"h0": [0, 1], "h1": [0]}`, in rank order."""
    out: dict[str, list[int]] = {}
    for d in devices:
        out.setdefault(host_of(d), []).append(device_index(d))
    return out


def foreseen(events: list[Event], allocation: list[str], pool: Pool) -> Iterator[list[str]]:
    """The allocation after each of `events` from `allocation`, but a rank's failure (which device it
    takes is known only then: it is left out); `pool` takes the hosts the events fail."""
    for e in events:
        if e.fail:
            continue
        pool.failed_hosts |= {*e.fail_hosts, *e.partition}
        allocation = allocate(Event(step=e.step) if e.fail_hosts or e.partition else e, allocation, pool)
        yield allocation


def refuse(events: list[Event], namespaces: bool) -> None:
    """What the agents cannot play, said before anything starts."""
    for e in events:
        if e.partition and not namespaces:
            raise DriverError(f"{e.describe()}: a partition needs namespace hosts (--network netns)")


class ScheduleDriver:
    """Plays `events` on `job`'s agents; `out` is where the job's rounds write their records."""

    def __init__(self, job: AgentJob, events: list[Event], out: Path, devices_per_host: int = 2) -> None:
        refuse(events, job.hosts.net is not None)
        self.job, self.events, self.out = job, events, out
        self.pool = Pool(devices_per_host)
        self.allocation: list[str] = []
        self.spares: set[str] = set()  # hosts whose agent waits, warm, to be let in (`--standby`)
        self.started = time.monotonic()  # events by time count from here
        self.log: list[dict[str, Any]] = []  # per event: when it was asked and the step it landed at

    def start(self, timeout: float = 300) -> None:
        """The first event's devices: an agent per host, its devices 0..n-1, and a warm spare for each
        host a later event adds; until the job's ranks loaded."""
        first = self.events[0]
        self.job.open_asker()  # warm for the first ask, which may be due a few steps after the start
        self.allocation = allocate(first, [], self.pool)
        for host, devices in by_host(self.allocation).items():
            self.job.start(host, nproc=len(devices))
        self._warm_spares(1)
        self._landed(lambda r: True, len(self.allocation), first, timeout)

    def follow(self, timeout: float = 300) -> None:
        """Every later event, in the schedule's order; each waits until the one before landed (one by time
        also until its second since the start). The spares never let in are told to leave at the end."""
        for i, e in enumerate(self.events[1:], 2):
            try:
                self._play(e, timeout)
            except AgentError:
                if not self._job_ended():
                    raise
                # the job trained its last step first (its steps outran the schedule): nothing more lands
                self.log += [
                    {"event": x.describe(), "step": x.step, "landed": None} for x in self.events[i - 1 :]
                ]
                break
            self._warm_spares(i)
        for host in sorted(self.spares):
            self.job.leave(host, timeout)
        self.spares.clear()
        self._reap(timeout)

    def _reap(self, timeout: float, host: str | None = None) -> None:
        """The agents told to leave (or `host`'s, before an agent starts there again) waited for: one that
        failed is an error, with its log. The schedule goes on meanwhile: a leaver keeps its store until
        the next round loaded, and ends after that."""
        names = list(self.job.leaving) if host is None else [h for h in [host] if h in self.job.leaving]
        for name in names:
            self.job.ended(name, timeout)

    def _play(self, e: Event, timeout: float) -> None:
        if e.time is not None:
            self.job.wait(f"second {e.time:g}", lambda: self._elapsed() >= e.time, e.time + timeout)
        if e.fail_hosts or e.partition:
            self._hosts_fail(e, timeout)
        elif e.fail:
            self._fail(e, timeout)
        else:
            self._plan(e, timeout)

    def _job_ended(self) -> bool:
        """Whether the job trained its last step: the agents of its newest round all ended well (they do
        then). Any other agent (a spare let in too late) is sent away."""
        placed = placements(self.job.hosts.run_dir)
        members = {host_of(d) for d in placed[max(placed)]} if placed else set()
        procs = [p for h, p in {**self.job.leaving, **self.job.agents}.items() if h in members]
        try:
            if not procs or any(p.wait(END_WAIT_S) for p in procs):
                return False
        except subprocess.TimeoutExpired:
            return False
        for host in [h for h in self.job.agents if h not in members]:
            self.job.dismiss(host)
            self.spares.discard(host)
        return True

    def timeline(self, steps: int | None, train: dict[str, Any]) -> list[dict[str, Any]]:
        """Once the job ended: its `timeline.jsonl` in `tenplex run`'s words (`agent_timeline`), which the
        report, the summary and the plot read."""
        start = Start(self.job.job, steps, [e.describe() for e in self.events], train)
        return write_timeline(self.out, self.job.hosts.run_dir, start)

    def _elapsed(self) -> float:
        return time.monotonic() - self.started

    def _warm_spares(self, index: int) -> None:
        """A warm spare for each host that an event from `index` on adds (as far as the allocation can be
        foreseen: which device a rank's failure takes is known only then) and that has no agent now."""
        pool = Pool(self.pool.devices_per_host, failed_hosts=set(self.pool.failed_hosts),
                    failed_devices=set(self.pool.failed_devices))  # fmt: skip
        alloc, first = self.allocation, {}
        for after in foreseen(self.events[index:], alloc, pool):
            for host, devices in by_host(after).items():
                if host not in by_host(alloc):
                    first.setdefault(host, len(devices))
            alloc = after
        for host, nproc in first.items():
            if host not in self.job.agents and host not in self.spares:
                self._reap(300.0, host)  # a host that left and comes back: its old agent ended first
                self.job.start(host, nproc=nproc, standby=True)
                self.spares.add(host)

    def _plan(self, e: Event, timeout: float) -> None:
        """A planned change: at its step (every ask with `--at-step`), or, by time, at the next step
        boundary (the asks without: that also clears an earlier event's step)."""
        at, asked = e.step, time.time()
        new = allocate(e, self.allocation, self.pool)
        before, after = by_host(self.allocation), by_host(new)
        layout = ",".join(f"{k}={v}" for k, v in e.layout.items()) if e.layout else "auto"
        # the event's spares warm before any ask: an event is one change, never a round without them first
        for host in (after.keys() - before.keys()) & self.spares:
            self.job.wait(f"the spare on {host}", lambda h=host: self.job.waiting(h), timeout)
        self.job.ask("layout", layout, at=at)  # first: no agent sees the others without the step
        for host in after.keys() - before.keys():  # next: a spare is let in, else one starts (and warms)
            self._join(host, after[host], at, timeout)
        for host in before.keys() & after.keys():
            if before[host] != after[host]:
                self.job.devices(host, after[host], at=at)
        leaving = sorted(before.keys() - after.keys())
        for host in leaving:
            self.job.leave(host, wait=False)
        self.allocation = new
        if at is None:
            landed = self._landed(lambda r: r["start"]["time"] > asked, len(new), e, timeout)
        else:
            landed = self._landed(lambda r: r["start"]["step"] >= at, len(new), e, timeout)
        self.log.append({"event": e.describe(), "step": at, "landed": landed})  # the leavers end meanwhile

    def _join(self, host: str, devices: list[int], at: int | None, timeout: float) -> None:
        """`host` joins at step `at`: its warm spare let in (with its devices asked first where the
        allocation gives it other ones than it warmed), else a new agent."""
        if host not in self.spares:
            self._reap(timeout, host)
            self.job.start(host, nproc=len(devices))
            return
        self.spares.discard(host)
        self.job.wait(f"the spare on {host}", lambda: self.job.waiting(host), timeout)
        if devices != list(range(len(devices))) or len(devices) != self.job.nprocs[host]:
            self.job.devices(host, devices, at=at)
        self.job.ask("admit", self.job.store_url(host), at=at)

    def _hosts_fail(self, e: Event, timeout: float) -> None:
        """Once the job trained the event's step: its hosts lost (`fail_hosts`: everything on them killed)
        or cut off (`partition`, namespace hosts: their links down, their agents left to the others'
        heartbeats), and a round without them loaded."""
        failed = self._trained(e, timeout)
        for host in (*e.fail_hosts, *e.partition):
            if host not in by_host(self.allocation):
                raise DriverError(f"{e.describe()}: {host} is not one of the job's hosts")
            if host in e.fail_hosts:
                self.job.lose(host)
            else:
                self.job.cut(host)
            self.pool.failed_hosts.add(host)
        self._recovered(e, failed, timeout)

    def _fail(self, e: Event, timeout: float) -> None:
        """Once the job trained the event's step: its ranks' devices fail (`tenplex devices --failed`: their
        workers killed at once), and a round without them loaded."""
        failed = self._trained(e, timeout)
        placed = self.job.ranks()
        if any(r >= len(placed) for r in e.fail):
            raise DriverError(f"{e.describe()}: the job has {len(placed)} ranks")
        gone = {placed[r] for r in e.fail}
        for host, devices in by_host(self.allocation).items():
            if any(h == host for h, _ in gone):
                self.job.devices(host, [d for d in devices if (host, d) not in gone], failed=True)
        self.pool.failed_devices |= {f"{h}/d{d}" for h, d in gone}
        self._recovered(e, failed, timeout)

    def _trained(self, e: Event, timeout: float) -> float:
        """Once the job trained the failure's step: when (the failure strikes now)."""
        at = e.step
        assert at is not None
        self.job.wait(f"step {at}", lambda: step_now(self.out) >= at, timeout)
        return time.time()

    def _recovered(self, e: Event, since: float, timeout: float) -> None:
        """The devices left after a failure at `since`, and the round that loaded without the failed."""
        self.allocation = allocate(Event(step=e.step), self.allocation, self.pool)
        landed = self._landed(lambda r: r["start"]["time"] > since, len(self.allocation), e, timeout)
        self.log.append({"event": e.describe(), "step": e.step, "landed": landed})

    def _landed(self, which: Any, world: int, e: Event, timeout: float) -> int:
        """The step the first round that `which` picks with `world` ranks loaded, once they are ready (a
        round of another size may come first: a host that joined late, or one found lost late)."""
        found: list[dict[str, Any]] = []

        def ready() -> bool:
            found[:] = [
                r for r in rounds(self.out) if r["ready"] and r["ready"]["world"] == world and which(r)
            ]
            return bool(found)

        self.job.wait(f"the round of {world} ranks after {e.describe()}", ready, timeout)
        return int(found[0]["start"]["step"])
