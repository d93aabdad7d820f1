"""Launching a phase: its worker spec, each rank's environment, and a process for each rank.

Rank processes come from a standby pool (pre-imported, reused across phases where they can be). Two seams
keep other host kinds (network namespaces, real clusters) small to add: `EmulatedHosts.store_url(host)`
starts a host's store, `Launcher.start_rank(host, ...)` starts one rank on a host.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..util import free_port, logs
from ..util.ranks import rank_env
from .hosts import EmulatedHosts, host_of
from .phase import Phase
from .spec import WorkerSpec
from .standby import Role, StandbyPool

log = logs.get("runtime")


class Launcher:
    def __init__(self, run_dir: Path, hosts: EmulatedHosts, pool_size: int) -> None:
        self.hosts = hosts
        self.pool = StandbyPool(run_dir / "standby.log", dict(os.environ, OMP_NUM_THREADS="1"), True)
        self.pool_size = pool_size

    def fill(self) -> None:
        """Spare processes for every rank the schedule will need: they import while the job trains."""
        self.pool.fill(self.pool_size)

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
        self.pool.close()
