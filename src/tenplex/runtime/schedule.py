"""The resource schedule: what devices the job has, from which step or second on.

A JSON or YAML list of events (or {"events": [...]}), each at a `step` or a `time` (seconds since start):

    - {step: 0, devices: 2}                  # start on 2 devices
    - {step: 10, devices: 4}                 # scale out
    - {step: 20, devices: 4, layout: {dp: 1, tp: 2, pp: 2}}   # force a layout (else the chooser decides)
    - {step: 25, hosts: [h2, h3]}            # move onto these emulated hosts
    - {step: 30, redeploy: true}             # move to disjoint, fresh hosts
    - {step: 40, fail: [1]}                  # kill rank 1 without warning
    - {step: 45, fail_hosts: [h1]}           # a whole host dies, its store too
    - {step: 50, partition: [h1]}            # a host is cut off (namespace hosts): dropped once detected
    - {time: 120, devices: 2}                # by wall time
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ptc import TenplexError
from ..ptc.layout import Layout
from .tables import read_table

KEYS = {"step", "time", "devices", "hosts", "redeploy", "fail", "fail_hosts", "partition", "layout"}


class ScheduleError(TenplexError, ValueError):
    """A malformed schedule."""


@dataclass(frozen=True)
class Event:
    step: int | None = None
    time: float | None = None
    devices: int | None = None
    hosts: tuple[str, ...] | None = None
    redeploy: bool = False
    fail: tuple[int, ...] = ()
    fail_hosts: tuple[str, ...] = ()
    partition: tuple[str, ...] = ()
    layout: dict[str, int] | None = field(default=None, hash=False)

    @property
    def is_failure(self) -> bool:
        return bool(self.fail or self.fail_hosts or self.partition)

    @property
    def forced(self) -> Layout | None:
        """The layout the event names (the next phase runs it if the devices fit), or None."""
        return Layout.from_dict(self.layout) if self.layout else None

    def describe(self) -> str:
        at = f"step {self.step}" if self.step is not None else f"{self.time:g} s"
        what = []
        if self.devices is not None:
            what.append(f"{self.devices} devices")
        if self.hosts:
            what.append("on " + ",".join(self.hosts))
        if self.redeploy:
            what.append("redeploy")
        if self.fail:
            what.append(f"fail ranks {list(self.fail)}")
        if self.fail_hosts:
            what.append(f"fail hosts {list(self.fail_hosts)}")
        if self.partition:
            what.append(f"partition {list(self.partition)}")
        if self.layout:
            what.append("layout " + ",".join(f"{k}={v}" for k, v in self.layout.items()))
        return f"{at}: {' '.join(what)}"


def _when(raw: dict, where: str) -> tuple[int | None, float | int | None]:
    """The event's step or time: exactly one of them, a non-negative integer step or seconds."""
    if ("step" in raw) == ("time" in raw):
        raise ScheduleError(f"{where} needs exactly one of 'step' or 'time'")
    step, time_ = raw.get("step"), raw.get("time")
    if step is not None and (type(step) is not int or step < 0):
        raise ScheduleError(f"{where}: step must be a non-negative integer, got {step!r}")
    if time_ is not None and (not isinstance(time_, (int, float)) or time_ < 0):
        raise ScheduleError(f"{where}: time must be non-negative seconds, got {time_!r}")
    return step, time_


def parse_event(raw: Any, index: int) -> Event:
    where = f"schedule event {index}"
    if not isinstance(raw, dict):
        raise ScheduleError(f"{where} must be a mapping, got {raw!r}")
    unknown = set(raw) - KEYS
    if unknown:
        raise ScheduleError(f"{where} has unknown keys {sorted(unknown)} (known: {', '.join(sorted(KEYS))})")
    step, time_ = _when(raw, where)
    devices = raw.get("devices")
    if devices is not None and (type(devices) is not int or devices < 1):
        raise ScheduleError(f"{where}: devices must be a positive integer, got {devices!r}")
    fail = raw.get("fail", [])
    if not isinstance(fail, list) or not all(type(r) is int and r >= 0 for r in fail):
        raise ScheduleError(f"{where}: fail must be a list of ranks, got {fail!r}")
    hosts, fail_hosts, partition = raw.get("hosts"), raw.get("fail_hosts", []), raw.get("partition", [])
    for name, v in (("hosts", hosts or []), ("fail_hosts", fail_hosts), ("partition", partition)):
        if not isinstance(v, list) or not all(isinstance(h, str) and h for h in v):
            raise ScheduleError(f"{where}: {name} must be a list of host names, got {v!r}")
    layout = raw.get("layout")
    if layout is not None and (
        not isinstance(layout, dict)
        or set(layout) - {"dp", "tp", "pp"}
        or not all(type(v) is int and v >= 1 for v in layout.values())
    ):
        raise ScheduleError(f"{where}: layout must look like {{dp: 2, tp: 1, pp: 2}}, got {layout!r}")
    if not isinstance(raw.get("redeploy", False), bool):
        raise ScheduleError(f"{where}: redeploy must be true or false")
    if time_ is not None and (fail or fail_hosts or partition):
        raise ScheduleError(f"{where}: failures are injected at a step (e.g. {{step: 40, fail: [1]}})")
    return Event(
        step,
        None if time_ is None else float(time_),
        devices,
        None if hosts is None else tuple(hosts),
        raw.get("redeploy", False),
        tuple(fail),
        tuple(fail_hosts),
        tuple(partition),
        layout,
    )


def parse_schedule(data: Any) -> list[Event]:
    if isinstance(data, dict):
        data = data.get("events")
    if not isinstance(data, list) or not data:
        raise ScheduleError("a schedule is a non-empty list of events (or {events: [...]})")
    events = [parse_event(raw, i) for i, raw in enumerate(data)]
    first = events[0]
    if first.devices is None or (first.step not in (0, None) or (first.time not in (0, None))):
        raise ScheduleError("the first event must be at step 0 (or time 0) and say how many devices")
    last = -1.0
    for i, e in enumerate(events):
        at = e.step if e.step is not None else None
        if at is not None:
            if at < last:
                raise ScheduleError(f"schedule event {i} at step {at} comes before the previous one")
            last = at
    return events


def load_schedule(path: str | Path) -> list[Event]:
    return parse_schedule(read_table(path, "schedule", ScheduleError))
