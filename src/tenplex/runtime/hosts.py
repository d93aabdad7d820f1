"""Emulated hosts on one machine: each with its own tensor store and a number of devices, and the
device allocation the schedule asks for.

Traffic between emulated hosts takes the stores' network path, so a reconfiguration moves its cross-host
bytes over real sockets even here. The stores' URLs and PIDs are kept in the run directory, so a rerun
of the controller finds them again (the snapshots live in the stores, not in the controller).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..ptc import TenplexError, device_id
from ..store import StoreClient, StoreError, start_store
from ..store.process import logged_stores
from .schedule import Event


class HostsError(TenplexError):
    """Not enough devices for what the schedule asks."""


def host_of(device: str) -> str:
    """The host of a device id (`h3/d1` -> `h3`)."""
    return device.split("/", 1)[0]


def device_index(device: str) -> int:
    """The device's index on its host (`h3/d1` -> 1)."""
    return int(device.rsplit("/d", 1)[1])


@dataclass
class EmulatedHosts:
    run_dir: Path
    devices_per_host: int = 2
    max_hosts: int = 16
    memory_limit: str = "8GiB"
    stores: dict[str, dict] = field(default_factory=dict)  # host -> {"url", "pid"}
    failed_devices: set[str] = field(default_factory=set)
    failed_hosts: set[str] = field(default_factory=set)
    partitioned: set[str] = field(default_factory=set)  # cut off from the others (namespace hosts only)
    allocation: list[str] = field(default_factory=list)  # device ids, in rank order
    # stores of spare hosts are started in a thread while the controller goes on (`Launcher.fill`)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    closed: bool = field(default=False, repr=False, compare=False)

    @property
    def control_host(self) -> str:
        """The address the ranks reach the controller at (its channel's store)."""
        return "127.0.0.1"

    # -- stores --------------------------------------------------------------------------------------------
    @property
    def _state_file(self) -> Path:
        return self.run_dir / "cluster.json"

    def save(self) -> None:
        with self.lock:
            state = {
                "devices_per_host": self.devices_per_host,
                "stores": self.stores,
                "failed_devices": sorted(self.failed_devices),
                "failed_hosts": sorted(self.failed_hosts),
                "allocation": self.allocation,
                # the controller: `tenplex stop RUN_DIR` stops it (and with it its ranks) while it runs
                "controller": {"pid": os.getpid(), "since": started_at(os.getpid())},
            }
            tmp = self._state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1))
            tmp.rename(self._state_file)  # whole: a controller killed mid-write leaves the last one

    def restore(self) -> bool:
        """Reload a previous controller's view; stores that still answer are reused."""
        if not self._state_file.exists():
            return False
        data = json.loads(self._state_file.read_text())
        self.devices_per_host = data["devices_per_host"]
        self.failed_devices, self.failed_hosts = set(data["failed_devices"]), set(data["failed_hosts"])
        self.allocation = data["allocation"]
        # a store is taken back only if the process answering at its URL is the one recorded: after a
        # reboot or a crash, the port (and the PID) may belong to someone else by now
        self.stores = {
            h: s for h, s in data["stores"].items() if _answers_as(s["url"], s["pid"]) and is_store(s)
        }
        self._adopt_unrecorded()
        return True

    def _adopt_unrecorded(self) -> None:
        """A controller killed while a store started leaves it running but unrecorded: take it back (it
        may already hold snapshots) instead of starting a second store for that host."""
        for log in sorted(self.run_dir.glob("store-*.log")):
            host = log.stem[len("store-") :]
            if host in self.stores or host in self.failed_hosts:
                continue
            for url, logged in reversed(logged_stores(str(log))):
                answer = health(url)
                if answer is not None and answer["pid"] == logged:  # not another store that took the port
                    self.stores[host] = {"url": url, "pid": logged, "since": started_at(logged)}
                    break
        self.save()

    def store_url(self, host: str) -> str:
        """The URL of `host`'s store, started on first use (the seam where a host's store is started)."""
        with self.lock:
            if host not in self.stores:
                self._check_open(host)
                self.stores[host] = self._start_store(host)
                self.save()
            return self.stores[host]["url"]

    def store_urls(self, hosts: list[str]) -> dict[str, str]:
        """The stores of `hosts`, those not running yet started at once (a redeploy starts several)."""
        with self.lock:
            missing = [h for h in hosts if h not in self.stores]
            if len(missing) > 1:
                self._check_open(missing[0])
                with ThreadPoolExecutor(len(missing)) as pool:
                    started = list(pool.map(self._start_store, missing))
                for h, s in zip(missing, started):
                    self.stores[h] = s
                self.save()
            return {h: self.store_url(h) for h in hosts}

    def _check_open(self, host: str) -> None:
        if self.closed:  # a spare host's store started after the shutdown would outlive the run
            raise HostsError(f"the hosts were shut down: no store is started for {host}")

    def _start_store(self, host: str) -> dict:
        sp = start_store(memory_limit=self.memory_limit, log=str(self.run_dir / f"store-{host}.log"))
        return {"url": sp.url, "pid": sp.proc.pid, "since": started_at(sp.proc.pid)}

    def kill_host(self, host: str) -> None:
        """A host failure: its store dies with its snapshots."""
        with self.lock:
            s = self.stores.pop(host, None)
            if s:
                _signal_store(s, signal.SIGKILL)
            self.failed_hosts.add(host)
            self.save()

    def shutdown(self) -> None:
        with self.lock:
            self.closed = True
            for s in self.stores.values():
                _signal_store(s, signal.SIGTERM)
            self.stores.clear()
            self.save()

    # -- devices -------------------------------------------------------------------------------------------
    def apply(self, event: Event) -> list[str]:
        """The device allocation after `event` (rank order: surviving devices keep their ranks' order)."""
        self.allocation = self.preview([event])
        self.save()
        return self.allocation

    def preview(self, events: list[Event]) -> list[str]:
        """The allocation `apply` would make of `events`, one after the other, changing nothing (a phase
        started ahead is planned on it)."""
        alloc = self.allocation
        for event in events:
            alloc = allocate(event, alloc, self)
        return alloc

    def fail_devices(self, devices: list[str]) -> None:
        self.failed_devices |= set(devices)
        self.save()


class Pool(Protocol):
    """The emulated hosts h0, h1, ... a job may take devices from, and those that failed."""

    devices_per_host: int
    max_hosts: int
    failed_devices: set[str]
    failed_hosts: set[str]


def allocate(event: Event, allocation: list[str], pool: Pool) -> list[str]:
    """The devices the job has after `event`, in rank order: the surviving devices keep their ranks' order;
    more devices come from the hosts in use first, then from the next hosts; fewer empty the last hosts
    first (whole hosts can then be released); a redeploy takes fresh hosts only, `hosts` those named."""
    gone = pool.failed_devices
    current = [d for d in allocation if d not in gone and host_of(d) not in pool.failed_hosts]
    n = event.devices if event.devices is not None else len(current)
    names = host_names(pool.max_hosts)

    def free(hosts: list[str], exclude: set[str]) -> list[str]:
        return [
            device_id(int(h[1:]), j)
            for h in hosts
            if h not in pool.failed_hosts
            for j in range(pool.devices_per_host)
            if device_id(int(h[1:]), j) not in exclude | gone
        ]

    if event.redeploy:
        used = {host_of(d) for d in allocation}
        current, spare = [], free([h for h in names if h not in used], set())
    elif event.hosts is not None:
        current = [d for d in current if host_of(d) in event.hosts]
        spare = free(list(event.hosts), set(current))
    else:
        in_use = list(dict.fromkeys(host_of(d) for d in current))
        spare = free(in_use + [h for h in names if h not in in_use], set(current))
    alloc = (current + spare)[:n] if n > len(current) else _shrink(current, n)
    if len(alloc) < n:
        raise HostsError(f"{event.describe()} needs {n} devices, only {len(alloc)} are available")
    return alloc


def host_names(count: int) -> list[str]:
    return [f"h{i}" for i in range(count)]


def _shrink(devices: list[str], n: int) -> list[str]:
    """Keep n devices, emptying the last hosts first (whole hosts can then be released)."""
    by_host: dict[str, list[str]] = {}
    for d in devices:
        by_host.setdefault(host_of(d), []).append(d)
    keep: set[str] = set()
    for host in by_host:
        for d in by_host[host]:
            if len(keep) < n:
                keep.add(d)
    return [d for d in devices if d in keep]


def health(url: str) -> dict | None:
    """The store's health, asked once with a short timeout; None when it does not answer."""
    try:
        return StoreClient(url, local=False, retries=0, timeout=2).health()
    except StoreError:
        return None


def _answers_as(url: str, pid: int) -> bool:
    answer = health(url)
    return answer is not None and answer.get("pid") == pid


def started_at(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the PID, an
    identity no later process has. None where there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the command name, which may hold spaces


def is_store(store: dict) -> bool:
    """Whether the recorded store's PID is still that store: the same process (start time) running a
    store; a PID reused by another process since is not signalled. Without a recorded start time (or
    /proc), the store must answer at its URL as that PID."""
    pid, since = store["pid"], store.get("since")
    if since is None or not Path("/proc/self/stat").exists():
        return _answers_as(store["url"], pid)
    if started_at(pid) != since:
        return False
    try:
        return b"tenplex.store" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False


def _signal_store(store: dict, sig: int) -> None:
    """Signal a recorded store, only if the process is still that store."""
    if not is_store(store):
        return
    try:
        os.kill(store["pid"], sig)
    except ProcessLookupError:
        pass
