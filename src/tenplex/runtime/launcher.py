"""Launching a phase: its worker spec, each rank's environment, and a process for each rank.

Rank processes come from a standby pool (pre-imported, reused across phases where they can be). Two seams
keep other host kinds (network namespaces, real clusters) small to add: `EmulatedHosts.store_url(host)`
starts a host's store, `Launcher.start_rank(host, ...)` starts one rank on a host.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

from ..util import free_port, logs
from ..util.ranks import rank_env
from .channel import Channel
from .hosts import EmulatedHosts, host_names, host_of
from .phase import Phase
from .spec import WorkerSpec
from .standby import Role, StandbyPool

log = logs.get("runtime")


class Launcher:
    def __init__(self, run_dir: Path, hosts: EmulatedHosts, pool_size: int, channel: Channel) -> None:
        self.hosts, self.channel = hosts, channel
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.pool = StandbyPool(run_dir / "standby.log", env, channel, die_with_parent=True)
        self.pool_size = pool_size
        self._spares: threading.Thread | None = None

    def fill(self, starting: bool = False) -> None:
        """Spare processes for every rank the schedule will need (they import while the job trains), and
        the stores of the spare hosts: a host's store runs before the job needs it, as a real host's would
        (started by a redeploy, their start-up would count as the redeploy's downtime). `starting`: the
        first phase is about to take its ranks from the pool, so start those as well: else the spares
        replacing them would import while the job's first change comes, slowing its build and first step
        (the demo's downtime parts: `results/demo.json`)."""
        self.pool.fill(self.pool_size + (len(self.hosts.allocation) if starting else 0))
        # in this thread: a store dies with the thread that started it (PR_SET_PDEATHSIG), so one started
        # by a helper thread would be killed when that thread ends, leaving its shared memory behind
        self._make_hosts([h for h in self.spare_hosts() if h not in self.hosts.stores])

    def spare_hosts(self) -> dict[str, int]:
        """The hosts to keep ready, with the ranks each may run: those the job is on (as many as each runs,
        for a restart after a failure) and the next unused ones (enough for the schedule's largest layout,
        for a scale-out or a redeploy); failed and cut-off hosts never."""
        hosts = self.hosts
        per_host: dict[str, int] = {}
        for d in hosts.allocation:
            per_host[host_of(d)] = per_host.get(host_of(d), 0) + 1
        spare = -(-self.pool_size // hosts.devices_per_host)
        for h in host_names(hosts.max_hosts):
            if spare <= 0:
                break
            if h not in per_host and h not in hosts.failed_hosts:
                per_host[h], spare = hosts.devices_per_host, spare - 1
        return {h: n for h, n in per_host.items() if h not in hosts.failed_hosts | hosts.partitioned}

    def start_stores(self, names: list[str]) -> None:
        """Start the stores of `names` that have none yet, in a thread (a store takes a while to start, and
        the controller keeps watching the job meanwhile); one such thread at a time. For namespace hosts,
        whose stores do not die with the thread that started them."""
        new = [h for h in names if h not in self.hosts.stores]
        if new and (self._spares is None or not self._spares.is_alive()):
            self._spares = threading.Thread(target=self._make_hosts, args=(new,), daemon=True)
            self._spares.start()

    def _make_hosts(self, names: list[str]) -> None:
        for h in names:
            try:
                with self.hosts.lock:
                    if h not in self.hosts.failed_hosts:
                        self.hosts.store_url(h)
            except Exception as e:  # a spare host is only an optimization: it is made when first used
                log.warning("spare host %s not made: %s", h, e)

    def launch(self, phase: Phase, spec: WorkerSpec, script: list[str] | None) -> None:
        """Write the phase's spec and start its ranks, rank r on `phase.devices[r]`."""
        path = spec.to_file(phase.dir / "spec.json")
        addr, port = self.master(phase)
        stores = self.hosts.store_urls(list(dict.fromkeys(host_of(d) for d in phase.devices)))
        sources = [s["url"] for s in self.hosts.stores.values()]  # a snapshot may be in any of them
        for rank, device in enumerate(phase.devices):
            host = host_of(device)
            placed = replace(spec, store=stores[host], device=device, sources=sources, emulated_hosts=True)
            env = rank_env(rank, len(phase.devices), port, addr, local_rank=device.rsplit("d", 1)[1])
            env.update(placed.rank_env(path))
            phase.procs.append(self.start_rank(host, env, phase.dir / f"rank{rank}.log", script))
        log.debug("phase %d: %d ranks started", phase.index, len(phase.devices))

    def master(self, phase: Phase) -> tuple[str, int]:
        """Where the phase's rank 0 serves its process group's rendezvous."""
        return "127.0.0.1", free_port()

    def start_rank(self, host: str, env: dict[str, str], out: Path, script: list[str] | None) -> Role:
        """One rank on `host` with `env`, its output to `out`: the reference rank, or `script`."""
        return self.pool.start(env, out, script)

    def release(self, role: Role) -> None:
        self.pool.release(role)

    def close(self) -> None:
        if self._spares is not None:
            self._spares.join()
        self.pool.close()
