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

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..ptc import TenplexError
from ..ptc.layout import Layout
from .tables import read_table


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


Step = Annotated[int, Meta(ge=0)]
Host = Annotated[str, Meta(min_length=1)]


class _Schema(msgspec.Struct, forbid_unknown_fields=True):
    """One event as the file may write it: `Event`'s fields, typed and bounded; msgspec checks it."""

    step: Step | None = None
    time: Annotated[float, Meta(ge=0)] | None = None
    devices: Annotated[int, Meta(ge=1)] | None = None
    hosts: tuple[Host, ...] | None = None
    redeploy: bool = False
    fail: tuple[Step, ...] = ()
    fail_hosts: tuple[Host, ...] = ()
    partition: tuple[Host, ...] = ()
    layout: dict[Literal["dp", "tp", "pp"], Annotated[int, Meta(ge=1)]] | None = None


KEYS = set(_Schema.__struct_fields__)
# what each key must be, for the one-line error that names it
MUST = {
    "step": "be a non-negative integer",
    "time": "be non-negative seconds",
    "devices": "be a positive integer",
    "hosts": "be a list of host names",
    "redeploy": "be true or false",
    "fail": "be a list of ranks",
    "fail_hosts": "be a list of host names",
    "partition": "be a list of host names",
    "layout": "look like {dp: 2, tp: 1, pp: 2}",
}
_AT = re.compile(r"`\$\.(\w+)")  # the first key of the path msgspec names


def _refusal(raw: Any, where: str, e: msgspec.ValidationError) -> ScheduleError:
    """msgspec's finding as the line that names the key and the value the file gave it."""
    if not isinstance(raw, dict):
        return ScheduleError(f"{where} must be a mapping, got {raw!r}")
    unknown = set(raw) - KEYS
    if unknown:
        known = ", ".join(sorted(KEYS))
        return ScheduleError(f"{where} has unknown keys {sorted(unknown, key=str)} (known: {known})")
    key = m.group(1) if (m := _AT.search(str(e))) else None
    if key not in MUST:  # no key to name: msgspec's own words
        return ScheduleError(f"{where}: {e}")
    return ScheduleError(f"{where}: {key} must {MUST[key]}, got {raw[key]!r}")


def parse_event(raw: Any, index: int) -> Event:
    where = f"schedule event {index}"
    try:
        event = Event(**msgspec.structs.asdict(msgspec.convert(raw, _Schema)))
    except msgspec.ValidationError as e:
        raise _refusal(raw, where, e) from None
    if (event.step is None) == (event.time is None):
        raise ScheduleError(f"{where} needs exactly one of 'step' or 'time'")
    if event.time is not None and event.is_failure:
        raise ScheduleError(f"{where}: failures are injected at a step (e.g. {{step: 40, fail: [1]}})")
    return event


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
