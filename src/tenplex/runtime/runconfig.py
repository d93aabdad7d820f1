"""What one `tenplex run` is asked to do: the job, its schedule and settings (checked by `validate`
before anything starts, carried out by the `Controller`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..train.config import TrainConfig
from .schedule import Event


@dataclass
class RunConfig:
    train: TrainConfig
    schedule: list[Event]
    steps: int | None  # None: a script's own step count (its `ElasticJob(until=...)`) ends the job
    run_dir: Path
    job: str = "tenplex-job"
    devices_per_host: int = 2
    snapshot_every: int | None = 5  # None: a script's own `ElasticJob(snapshot_every=...)`
    table: dict | None = None
    persist: bool = True  # write a DCP snapshot at every reconfiguration (the durable tier)
    quiet: bool = False
    script: list[str] | None = None  # a training script using `ElasticJob`, with its arguments
    network: str = "loopback"  # or "netns": every host a network namespace (see runtime/netns_hosts.py)
    nic_gbps: float | None = None  # netns: each host's NIC, each way (None: unshaped)
    nic_latency_ms: float | None = None
    replicas: int = 0  # netns: copies of each snapshot blob on the next hosts' stores
    store_memory: int | None = None  # bytes each host's store may hold (None: the hosts' default)
    ahead: bool = True  # start a planned change's ranks while the phase before trains (CPU devices only)
    fresh: bool = False  # start over from step 0 even when the stores of an earlier run are lost
