"""The elastic runtime on namespace hosts (`tenplex run --network netns`): every emulated host a network
namespace with its own address, shaped NIC, tensor store (bound to that address, token required) and
ranks started inside it; gloo across the hosts' interfaces.

The controller itself moves into a namespace of the run (`ctl`, unshaped) before it starts any thread, so
it reaches the hosts' addresses while the machine's own network never gets one. A host failure kills
everything in the host's namespace and deletes it; a partition takes its link down and leaves its
processes running: the controller notices that the host's store stopped answering, drops the host and
goes on without it, and the cut-off ranks, whose peers are gone, can commit nothing anywhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

from ..store import StoreClient, StoreError
from ..util import default_token_path, logs, read_token
from .channel import Channel
from .hosts import EmulatedHosts, health, host_of, started_at
from .launcher import Launcher
from .netns import NIC, Network, prefix_for
from .phase import Phase
from .standby import Role, StandbyPool

log = logs.get("runtime")
CLONE_NEWNET = 0x40000000
MASTER_PORT = 29500  # every host has its own ports; + the phase's index (an old phase's port may linger)


def enter(ns: str) -> int:
    """Move this thread (and the threads it starts later) into namespace `ns`; a handle on the one it
    was in, for `leave`. Call it before starting threads: threads started earlier stay where they are."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)
    return home


def leave(home: int) -> None:
    try:
        _setns(home)
    finally:
        os.close(home)


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):  # Python 3.12+
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class NamespaceHosts(EmulatedHosts):
    """`EmulatedHosts` whose hosts are namespaces of one `Network` (one per run directory)."""

    def __init__(
        self,
        run_dir: Path,
        devices_per_host: int = 2,
        gbps: float | None = None,
        latency_ms: float | None = None,
        replicas: int = 0,
        memory_limit: str = "8GiB",
    ) -> None:
        super().__init__(run_dir, devices_per_host, memory_limit=memory_limit)
        self.replicas = replicas
        self.net = Network(prefix_for(str(run_dir.resolve())), gbps, latency_ms)  # a killed run's go first
        # the user's token file (made 0600 if missing): every same-user client finds it by itself, so the
        # controller's clients of other (loopback) stores, as in the demo's static run, keep working
        self.token_file = default_token_path()
        read_token(self.token_file, create=True)
        self.ctl = self.net.add_host("ctl", shaped=False)
        self._home: int | None = enter(self.ctl.ns)
        self._procs: dict[str, subprocess.Popen] = {}
        self.dropped: dict[str, str] = {}  # cut-off hosts the job went on without -> their store's URL
        self.final: dict[str, dict] = {}  # failed hosts: their address and counters when they died

    @property
    def control_host(self) -> str:
        return self.ctl.addr

    def store_url(self, host: str) -> str:
        with self.lock:
            return self._store_url(host)

    def _store_url(self, host: str) -> str:
        if host not in self.stores:
            self._check_open(host)
            self.net.add_host(host)
            out = str(self.run_dir / f"store-{host}.log")
            url, proc = self.net.start_store(host, self.token_file, out, self.memory_limit)
            self._procs[host] = proc
            addr = self.net.hosts[host].addr
            self.stores[host] = {"url": url, "pid": proc.pid, "since": started_at(proc.pid), "addr": addr}
            self._ring()
            self.save()
        return self.stores[host]["url"]

    def store_urls(self, hosts: list[str]) -> dict[str, str]:
        """One after the other: hosts are added to one network."""
        return {h: self.store_url(h) for h in hosts}

    def _ring(self) -> None:
        """Every live store replicates to the next ones of the ring of all live stores."""
        if not self.replicas:
            return
        urls = [s["url"] for s in self.stores.values()]
        for url in urls:
            try:
                StoreClient(url, retries=0, timeout=5, local=False).set_peers(urls, self.replicas)
            except StoreError as e:
                log.warning("store %s did not take its replication peers: %s", url, e)

    def kill_host(self, host: str) -> None:
        """A host failure: every process in its namespace (ranks and store) is killed, it is deleted."""
        with self.lock:
            self._kill_host(host)

    def _kill_host(self, host: str) -> None:
        self.stores.pop(host, None)
        if host in self.net.hosts:
            self.final[host] = {"addr": self.net.hosts[host].addr, **self.net.counters(host), "failed": True}
        self.net.kill_host(host)
        self._reap(host)
        self.failed_hosts.add(host)
        self._ring()
        self.save()

    def partition(self, host: str) -> None:
        """Cut `host` off; its processes keep running."""
        self.net.partition(host)
        self.partitioned.add(host)

    def unreachable(self, hosts: set[str]) -> set[str]:
        """Those of `hosts` whose store does not answer (health, 2 s)."""
        return {h for h in hosts if h in self.stores and health(self.stores[h]["url"]) is None}

    def heal(self, host: str) -> None:
        """Bring a cut-off host's link back; a dropped host's store is told to replicate nowhere."""
        self.net.heal(host)
        if host in self.dropped:
            try:
                StoreClient(self.dropped[host], retries=0, timeout=5, local=False).set_peers([], 0)
            except StoreError as e:
                log.warning("the dropped store of %s did not take an empty peer list: %s", host, e)

    def drop_host(self, host: str) -> None:
        """Go on without a host that cannot be reached: it is never used again, its store never read."""
        with self.lock:
            self._drop_host(host)

    def _drop_host(self, host: str) -> None:
        gone = self.stores.pop(host, None)
        if gone:
            self.dropped[host] = gone["url"]
        self.failed_hosts.add(host)
        self._ring()
        self.save()

    def network(self) -> dict[str, dict]:
        """Each host's address and its bytes in and out so far (its interface counters)."""
        with self.lock:
            return self._network()

    def _network(self) -> dict[str, dict]:
        out = dict(self.final)
        for name, h in self.net.hosts.items():
            if name != "ctl":
                out[name] = {"addr": h.addr, **self.net.counters(name), "cut_off": name in self.partitioned}
        return out

    def shutdown(self) -> None:
        """Stop the stores, leave the controller's namespace, delete every namespace of the run."""
        with self.lock:
            self.closed = True
        for host in list(self._procs):
            if self._procs[host].poll() is None:
                self._procs[host].send_signal(signal.SIGTERM)
        for host in list(self._procs):
            self._reap(host, timeout=10)
        self.stores.clear()
        self.save()
        if self._home is not None:
            leave(self._home)
            self._home = None
        self.net.close()

    def _reap(self, host: str, timeout: float = 5) -> None:
        proc = self._procs.pop(host, None)
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class NamespaceLauncher(Launcher):
    """Ranks started inside their host: one standby pool per host, spawned in its namespace."""

    def __init__(self, run_dir: Path, hosts: NamespaceHosts, pool_size: int, channel: Channel) -> None:
        super().__init__(run_dir, hosts, pool_size, channel)
        self.pool.close()  # the machine-wide pool is not used: a process cannot change hosts
        self.run_dir, self.nshosts = run_dir, hosts
        self.pools: dict[str, StandbyPool] = {}
        self._owner: dict[int, StandbyPool] = {}

    def _pool(self, host: str) -> StandbyPool:
        """The host's pool (the controller's main thread only: see `fill`)."""
        if host not in self.pools:
            env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=NIC)
            wrap = self.nshosts.net.hosts[host].argv([])
            log = self.run_dir / f"standby-{host}.log"
            self.pools[host] = StandbyPool(log, env, self.channel, die_with_parent=True, wrap=wrap)
        return self.pools[host]

    def fill(self, starting: bool = False) -> None:
        """Spares on the hosts `spare_hosts` names, as many as each may run (`starting`: and the first
        phase's ranks there): a process cannot move between hosts, so each host imports its own."""
        want = self.spare_hosts()
        first = [host_of(d) for d in self.nshosts.allocation] if starting else []
        ready = [h for h in want if h in self.nshosts.stores]  # no lock: a host being made is not ready yet
        for h in ready:  # processes are started here, in the controller's main thread: a standby process
            self._pool(h).fill(want[h] + first.count(h))  # dies with the thread that started it (PDEATHSIG)
        self.start_stores([h for h in want if h not in ready])  # their spares: at the next fill

    def master(self, phase: Phase) -> tuple[str, int]:
        host = phase.devices[0].split("/", 1)[0]
        self.nshosts.store_url(host)  # the host exists once its store does
        return self.nshosts.net.hosts[host].addr, MASTER_PORT + phase.index % 1000

    def start_rank(self, host: str, env: dict[str, str], out: Path, script: list[str] | None) -> Role:
        pool = self._pool(host)
        role = pool.start(dict(env, GLOO_SOCKET_IFNAME=NIC), out, script)
        self._owner[id(role)] = pool
        return role

    def release(self, role: Role) -> None:
        pool = self._owner.pop(id(role), None)
        if pool is not None and role.proc.poll() is None and self._alive(pool):
            pool.release(role)

    def _alive(self, pool: StandbyPool) -> bool:
        return any(p is pool and h in self.nshosts.net.hosts for h, p in self.pools.items())

    def close(self) -> None:
        super().close()
        for pool in self.pools.values():
            pool.close()
