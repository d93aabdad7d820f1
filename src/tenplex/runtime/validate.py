"""A run checked whole before its first step: every event of the resource schedule against the hosts
(enough devices, hosts that exist, failures that name ranks and hosts the job has then), every layout it
forces, the para-config, and the chooser's answer for every device count the job will run on. A problem
found at step 40 after 40 steps, with stores left behind, is one found here with nothing started.

The walk follows the controller's rules: events in the order listed (those at or past the last step never
apply), a failure leaves the survivors, a forced layout holds until the next event and gives way to the
chooser once a failure leaves it the wrong size. A user's script lays itself out inside its ranks: for it
only what is known before it runs is checked (device counts, failures, a forced layout's or a para-config
entry's size), not whether its model can take a layout.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..ptc import GPTConfig, PTCError, TenplexError, preset
from ..ptc.layout import Layout
from .chooser import choose, parse_table
from .hosts import EmulatedHosts, HostsError, host_of
from .runconfig import RunConfig
from .schedule import Event


class RunCheckError(TenplexError):
    """A schedule, layout or para-config the run could not carry out; found before anything starts."""


def check_run(cfg: RunConfig) -> None:
    """Raise RunCheckError (one line) for the first thing in `cfg` the run could not carry out."""
    model = None if cfg.script else preset(cfg.train.model)
    try:
        _check_table(cfg, model)
    except TenplexError as e:
        raise RunCheckError(str(e)) from None
    hosts = EmulatedHosts(Path("."), cfg.devices_per_host)  # a scratch view: nothing started or saved
    alloc: list[str] = []
    forced: Layout | None = None
    for i, e in enumerate(cfg.schedule):
        if cfg.steps is not None and e.step is not None and e.step >= cfg.steps and i > 0:
            continue  # the job ends before it
        where = f"schedule event {i} ({e.describe()})"
        try:
            if e.is_failure:
                alloc = _fail(hosts, e, alloc, cfg.network)
            else:
                alloc = _change(hosts, e, alloc)
                forced = Layout.from_dict(e.layout) if e.layout else None
                if forced is not None and forced.world != len(alloc):
                    raise RunCheckError(
                        f"layout {forced} (sizes left out are 1) needs {forced.world} devices, "
                        f"the job has {len(alloc)} then"
                    )
            layout = forced if forced is not None and forced.world == len(alloc) else None
            _check_layout(cfg, model, layout, len(alloc))
        except (TenplexError, ValueError) as err:
            raise RunCheckError(f"{where}: {err}") from None


def _check_table(cfg: RunConfig, model: GPTConfig | None) -> None:
    """The para-config, each entry checked against the model (a script's: only its size)."""
    table = parse_table(cfg.table) if cfg.table else {}  # its sizes
    for n, lay in table.items() if model is not None else ():
        try:
            lay.check(model, n)
        except PTCError as e:
            raise PTCError(f"para-config entry {n}: {e}") from None


def _change(hosts: EmulatedHosts, e: Event, alloc: list[str]) -> list[str]:
    """The allocation after a planned event, as the controller's hosts would make it."""
    for h in e.hosts or ():
        if not re.fullmatch(r"h\d+", h) or int(h[1:]) >= hosts.max_hosts:
            raise RunCheckError(f"no host {h!r}: the emulated hosts are h0..h{hosts.max_hosts - 1}")
        if h in hosts.failed_hosts:
            raise RunCheckError(f"host {h} failed earlier in the schedule")
    hosts.allocation = alloc
    try:
        return hosts.preview([e])
    except HostsError as err:
        cap = hosts.max_hosts * hosts.devices_per_host
        short = str(err).removeprefix(f"{e.describe()} ")
        raise RunCheckError(f"{short} ({hosts.max_hosts} hosts of {hosts.devices_per_host} devices, "
                            f"{cap} in all; --devices-per-host sets the second)") from None  # fmt: skip


def _fail(hosts: EmulatedHosts, e: Event, alloc: list[str], network: str) -> list[str]:
    """The survivors of a failure; the ranks and hosts it names must be the job's at that point."""
    used = list(dict.fromkeys(host_of(d) for d in alloc))
    bad = [r for r in e.fail if r >= len(alloc)]
    if bad:
        raise RunCheckError(f"the job has {len(alloc)} ranks then (0..{len(alloc) - 1}), no rank {bad[0]}")
    named = [*e.fail_hosts, *e.partition]
    if any(h not in used for h in named):
        h = next(h for h in named if h not in used)
        raise RunCheckError(f"host {h} runs none of the job's ranks then (it runs on {', '.join(used)})")
    if e.partition and network != "netns":
        raise RunCheckError("a partition needs namespace hosts (--network netns)")
    gone = {alloc[r] for r in e.fail} | {d for d in alloc if host_of(d) in {*e.fail_hosts, *e.partition}}
    hosts.failed_devices |= {alloc[r] for r in e.fail}
    hosts.failed_hosts |= set(e.fail_hosts) | set(e.partition)
    survivors = [d for d in alloc if d not in gone]
    if not survivors:
        raise RunCheckError("no devices are left after it")
    return survivors


def _check_layout(cfg: RunConfig, model: GPTConfig | None, forced: Layout | None, devices: int) -> None:
    """The layout the phase will run fits the model (the reference workload) or at least the devices."""
    if model is None:  # a script: its layout is its own, the sizes were checked
        return
    if forced is not None:
        forced.check(model, devices)
        return
    t = cfg.train
    choose(t.model, devices, t.global_batch, t.micro_batch, table=cfg.table)
