"""Every record the runtime writes, one dataclass per kind: a rank's (its phase's or round's `worker.jsonl`,
its ledgers), the controller's (`timeline.jsonl`) and an agent's (`agent.jsonl`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .records import Kind, Record


# -- a rank's ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings(Record):
    kind = Kind.SETTINGS
    steps: int | None  # the job's end: the command line's, else the script's own
    snapshot_every: int
    overridden: list[str]  # the script's own settings the command line replaced


@dataclass(frozen=True)
class Waiting(Record):
    kind = Kind.WAITING
    seconds: float  # started ahead: built this long after the rank's start


@dataclass(frozen=True)
class Fresh(Record):
    kind = Kind.FRESH
    step: int
    layout: str
    forced: bool | None = None  # --fresh although stores that may hold a snapshot are lost
    lost_stores: Any = None


@dataclass(frozen=True)
class Loaded(Record):
    kind = Kind.LOADED
    step: int
    seconds: float
    bytes: Any
    source: str
    plan: Any
    lost_stores: Any
    lost_why: Any
    replaced: Any
    phases: Any
    layout: str
    skipped: Any


@dataclass(frozen=True)
class Ready(Record):
    kind = Kind.READY
    step: int
    init_at: float
    process_group_seconds: float
    load_seconds: float
    build_seconds: float
    layout: str
    pid: int
    pids: list[int]
    world: int
    ahead: bool | None = None
    go_at: float | None = None


@dataclass(frozen=True)
class Step(Record):
    kind = Kind.STEP
    step: int
    loss: float


@dataclass(frozen=True)
class Snapshot(Record):
    kind = Kind.SNAPSHOT
    step: int
    stall: float
    mode: str


@dataclass(frozen=True)
class Unreplicated(Record):
    kind = Kind.UNREPLICATED
    step: int
    replication: dict[str, str]
    phase: int | None = None  # the timeline's copy names its phase


@dataclass(frozen=True)
class StoreFull(Record):
    kind = Kind.STORE_FULL
    step: int
    error: str
    skipped: bool
    keep: int


@dataclass(frozen=True)
class Saved(Record):
    kind = Kind.SAVED
    step: int
    seconds: float
    bytes: int
    phases: Any = None
    already: bool | None = None  # the step was committed already (loaded or snapshotted at it)


@dataclass(frozen=True)
class SaveFailed(Record):
    kind = Kind.SAVE_FAILED
    step: int
    error: str


@dataclass(frozen=True)
class Done(Record):
    kind = Kind.DONE
    step: int


@dataclass(frozen=True)
class Samples(Record):
    kind = Kind.SAMPLES
    step: int
    dp: int
    ids: list[int]


# -- the controller's -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Start(Record):
    kind = Kind.START
    job: str
    steps: int | None
    schedule: list[str]
    train: dict[str, Any]


@dataclass(frozen=True)
class Resume(Record):
    kind = Kind.RESUME
    step: int
    stores: dict[str, Any]
    caught_up: Any


@dataclass(frozen=True)
class Applied(Record):
    kind = Kind.EVENT
    step: int
    event: str
    devices: list[str]


@dataclass(frozen=True)
class Launch(Record):
    kind = Kind.LAUNCH
    phase: int
    layout: str
    devices: list[str]
    step: int
    until: int
    hosts: list[str]
    ahead: bool | None = None  # the phase was started ahead


@dataclass(frozen=True)
class Ahead(Record):
    kind = Kind.AHEAD
    phase: int
    layout: str
    devices: list[str]
    step: int
    at: int  # the step the phase before had reached


@dataclass(frozen=True)
class AheadSkipped(Record):
    kind = Kind.AHEAD_SKIPPED
    phase: int
    error: str


@dataclass(frozen=True)
class Worker(Record):
    kind = Kind.WORKER
    phase: int
    event: str  # the rank's record's kind
    at: float  # its time


@dataclass(frozen=True)
class Crash(Record):
    kind = Kind.CRASH
    phase: int
    ranks: list[int]
    step: int


@dataclass(frozen=True)
class Fail(Record):
    kind = Kind.FAIL
    phase: int
    step: int
    ranks: list[int]
    hosts: list[str]
    devices: list[str]


@dataclass(frozen=True)
class FailSkipped(Record):
    kind = Kind.FAIL_SKIPPED
    phase: int
    event: str
    why: str | None = None


@dataclass(frozen=True)
class Partition(Record):
    kind = Kind.PARTITION
    phase: int
    step: int
    hosts: list[str]


@dataclass(frozen=True)
class PartitionDetected(Record):
    kind = Kind.PARTITION_DETECTED
    phase: int
    step: int
    hosts: list[str]
    ranks: list[int]
    seconds: dict[str, float]


@dataclass(frozen=True)
class Heal(Record):
    kind = Kind.HEAL
    phase: int
    ranks: list[int]


@dataclass(frozen=True)
class Recover(Record):
    kind = Kind.RECOVER
    step: int
    lost_steps: int
    devices: list[str]


@dataclass(frozen=True)
class Reconfig(Record):
    kind = Kind.RECONFIG  # its fields are `downtime.reconfiguration`'s (one of them is named `from`)


@dataclass(frozen=True)
class StoresLost(Record):
    kind = Kind.STORES_LOST
    lost: dict[str, str]
    phase: int | None = None  # a phase's ranks loaded without them
    step: int | None = None
    durable: str | None = None  # a rerun's stores were lost: what it starts from instead
    fresh: bool | None = None


@dataclass(frozen=True)
class SnapshotsSkipped(Record):
    kind = Kind.SNAPSHOTS_SKIPPED
    phase: int
    steps: list[int]
    step: int
    errors: list[str]


@dataclass(frozen=True)
class Unmatched(Record):
    kind = Kind.MATCH_SKIPPED
    layout: str
    error: str


@dataclass(frozen=True)
class Persist(Record):
    kind = Kind.PERSIST
    step: int
    path: str
    seconds: float
    bytes: int


@dataclass(frozen=True)
class PersistFailed(Record):
    kind = Kind.PERSIST_FAILED
    step: int
    error: str


@dataclass(frozen=True)
class Network(Record):
    kind = Kind.NETWORK
    hosts: dict[str, Any]


@dataclass(frozen=True)
class GiveUp(Record):
    kind = Kind.GIVE_UP
    step: int
    error: str | None = None
    crashes: int | None = None
    logs: str | None = None


@dataclass(frozen=True)
class Finish(Record):
    kind = Kind.FINISH
    step: int
    seconds: float
    durable: str | None


# -- an agent's -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Store(Record):
    kind = Kind.STORE
    url: str
    attached: bool
    incarnation: str


@dataclass(frozen=True)
class Warm(Record):
    kind = Kind.WARM
    seconds: float


@dataclass(frozen=True)
class RoundFormed(Record):
    kind = Kind.ROUND
    round: int
    node: int
    nodes: int
    world: int
    stores: list[str]
    hosts: list[str]
    lost_stores: list[str]  # stores of hosts lost so far (not those that left)
    devices: list[int]  # this host's devices in the round (one worker each)
    rendezvous_s: float
    retired: list[str]  # other stores the round's loads count lost unasked (`Membership.retired`)


@dataclass(frozen=True)
class Change(Record):
    kind = Kind.CHANGE
    round: int
    why: str
    at: int | None = None  # the step the change waits for (`--at-step`); None: the next step boundary


@dataclass(frozen=True)
class FoundLost(Record):
    kind = Kind.FOUND_LOST  # a member's store refused or its host was unreachable: out of the rendezvous
    round: int
    store: str


@dataclass(frozen=True)
class RoundLoaded(Record):
    kind = Kind.LOADED  # in agent.jsonl: the round's ranks loaded
    round: int


@dataclass(frozen=True)
class WorkerFailed(Record):
    kind = Kind.WORKER_FAILED
    round: int
    slot: int
    log: str
    outcome: str
    error: str


@dataclass(frozen=True)
class Standby(Record):
    kind = Kind.STANDBY  # a warm spare (`--standby`) waits to be let in (`tenplex admit`)
    store: str


@dataclass(frozen=True)
class Left(Record):
    kind = Kind.LEFT
    round: int


@dataclass(frozen=True)
class End(Record):
    kind = Kind.END
    why: str
    round: int
