"""What one `tenplex run` is asked to do: the job, its schedule and settings (checked by `validate`
before anything starts, carried out by the `Controller`). The flags of `tenplex run` are derived from these
fields (`util.flags`); those the command converts (a path read into a schedule) say so in `run_cmd`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..train.config import TrainConfig
from ..util.flags import flag, size
from .schedule import Event

# The reference workload of `tenplex run` and `tenplex demo`: TrainConfig's defaults but for these, a short
# run on CPUs (50 steps: a shorter warm-up to a higher peak). Their --help shows these values.
REFERENCE: dict[str, Any] = {"steps": 50, "lr": 3e-3, "warmup": 5, "device": "cpu"}
REFERENCE_SNAPSHOT_EVERY = 5  # the reference workload's snapshot interval, unless given

_SCRIPTS_OWN = "with --script, the script's own ElasticJob({}=...), which this replaces, saying so"


@dataclass
class RunConfig:
    train: TrainConfig
    schedule: list[Event] = flag(
        help="the resource schedule: a JSON or YAML list of events (docs/runtime.md), "
        "checked whole before the first step",
        required=True,
    )
    # None: a script's own step count (its `ElasticJob(until=...)`) ends the job
    steps: int | None = flag(
        help=f"steps to train (default: {REFERENCE['steps']}; {_SCRIPTS_OWN.format('until')})"
    )
    run_dir: Path = flag(
        help="where the timeline, plot and the stores' record go (default: runs/JOB); the same "
        "one again resumes"
    )
    job: str = flag("tenplex-job", "the job's name in the stores (a script's own is replaced)")
    devices_per_host: int = flag(2, "devices of each emulated host")
    snapshot_every: int | None = flag(
        REFERENCE_SNAPSHOT_EVERY,  # None: a script's own `ElasticJob(snapshot_every=...)`
        f"asynchronous in-memory snapshot every N steps, 0: never (default: {REFERENCE_SNAPSHOT_EVERY}; "
        f"{_SCRIPTS_OWN.format('snapshot_every')})",
        cli_default=None,
    )
    table: dict | None = flag(
        None,
        "JSON or YAML table devices -> {dp, tp, pp} that overrides the chooser",
        names=("--para-config",),
        metavar="TABLE",
    )
    persist: bool = True  # write a DCP snapshot at every reconfiguration (the durable tier)
    quiet: bool = flag(False, "no live view, only the report at the end")
    # a training script using `ElasticJob`, with its arguments
    script: list[str] | None = flag(
        None,
        "run your own training script (it uses tenplex.ElasticJob) instead of "
        "the reference workload; the script lays itself out (--model then only "
        "guides the checks of forced layouts)",
        metavar='"TRAIN.PY ARGS"',
    )
    # every host a network namespace (runtime/netns_hosts.py) instead of loopback stores
    network: str = flag(
        "loopback",
        "emulated hosts as loopback stores or network namespaces (root; docs/netns.md)",
        choices=("loopback", "netns"),
    )
    nic_gbps: float | None = flag(None, "netns: each host's NIC, each way (default: unshaped)")
    nic_latency_ms: float | None = flag(None, "netns: added latency per host link (needs netem)")
    replicas: int = flag(0, "netns: copies of each snapshot on the next hosts")
    store_memory: int | None = flag(
        None,
        "the memory limit of every host's store, e.g. 512MiB (default 8GiB); "
        "a snapshot that does not fit is skipped, with a warning",
        type=size,
        metavar="SIZE",
    )
    ahead: bool = flag(
        True,
        "start a planned change's ranks only once the old layout stopped (default on "
        "CPUs: while it trains, so that they are built and warm when it stops)",
        names=("--no-ahead",),
        action="store_false",
    )
    fresh: bool = flag(
        False,
        "start over from step 0 when the stores of an earlier run of this --run-dir are "
        "lost (without it such a rerun stops with the lost stores named, so no snapshot is "
        "thrown away unasked)",
    )
    keep_stores: bool = flag(
        False, "leave the emulated hosts' stores running after the job (for tenplex inspect / store ls)"
    )
