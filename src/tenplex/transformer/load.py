"""`tenplex.load`: rank 0 chooses the snapshot and plans every rank's reads; each rank pulls its boxes.

Orchestration only, over the three roles: the target's shards are gathered to rank 0 (`gathered`), which
chooses the snapshot (`snapshot`), plans the whole job once (`planner`) and deals each rank its reads; the
executor (`fetch`) moves the bytes, the ranks `agree` on the outcome, and `durable` takes over when memory
cannot serve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..planner import Plan, plan
from ..ptc import PTC
from ..util import collector, env
from . import world
from .agree import Failed, agree, attempt
from .breakdown import Breakdown
from .durable import load_durable
from .errors import KeyMismatchError, NoSnapshotError, ShapeMismatchError, StateError, UnrecoverableError
from .fetch import HeldBoxes, Read, Ways, drop_relays, moved_bytes, reads_of, shared_remote_boxes, ways
from .gathered import RankShards, build_ptc, describe, merged_values, subset
from .shards import LocalShard, local_shard
from .snapshot import LoadInfo, Snapshot, Version, choose
from .stores import resolve
from .tree import expand, flatten, restore


@collector.paused()
def load(  # noqa: PLR0913 (the public signature, DCP-shaped: every option by keyword)
    state_dict: dict[str, Any],
    job: str,
    step: int | None = None,
    *,
    store: str | None = None,
    strict: bool = True,
    central: bool = False,
    path: str | None = None,
    concurrency: int = 8,
    process_group: world.Group = None,
    sources: list[str] | None = None,
    atomic: bool = True,
) -> LoadInfo:
    """Fill `state_dict` in place from version `step` (default: the newest committed) of `job`.

    The target layout is whatever the tensors handed in are. `central=True` routes every byte through
    one host's store (the paper's Tenplex-Central baseline). `path` names a persisted DCP snapshot to fall
    back to when the stores cannot serve the snapshot. `process_group`: the ranks of the job.
    `sources`: more stores to look for the snapshot in (default $TENPLEX_SOURCES, comma-separated) — the
    old hosts' stores when the job moved to new hosts; the ranks' own stores are always searched.
    Without `step`, a snapshot that cannot be read (bytes that fail their checksums, a blob gone) gives way
    to the newest one before it, then to `path`; `LoadInfo.skipped` lists those passed over, and why.
    `atomic=False`: boxes from other hosts land straight in their CPU targets, not in scratch memory first
    (no scratch to fault in, no second copy); a load that raises then leaves those targets part written
    (one that falls back to an older snapshot or `path` still writes every box of the one it returns; with
    `strict=False` it raises instead of falling back, as the older one may lack a tensor it wrote). For
    a state that is replaced whole anyway: a replica rejoining, a job starting. Default: a load that raises
    leaves every target as it was.
    """
    run = _Load(
        state_dict, job, step, resolve(store), strict, central, path, concurrency, process_group, atomic
    )
    with run.bd.phase("describe"):
        tree = expand(run.state_dict)
        tensors, values = flatten(tree)
        shards = {n: local_shard(n, t) for n, t in tensors.items()}
    mine = describe(run.url, shards, values, run.group)
    planner = _Planner(run, env.url_list(env.SOURCES) if sources is None else sources)  # rank 0's
    t = time.perf_counter()
    turn, part = world.gather_then_deal(mine, planner.first, run.group)
    run.bd.add("gather", time.perf_counter() - t - sum(turn.spent.values()))
    while True:  # newest first: a snapshot that cannot be read gives way to the one before
        for name, seconds in turn.spent.items():  # rank 0's choice and plan, which every rank waits for
            run.bd.add(name, seconds)
        run.skipped = turn.skipped
        if isinstance(turn, _Stop):
            return run.fallback(turn.reason, turn.error)
        failed, moved = _read(turn, part, shards, run)
        if failed is None:
            return _loaded(turn, moved, tree, values, run)
        info = _after_failure(failed, turn.step, run)
        if info is not None:
            return info
        turn, part = world.deal(partial(planner.next, turn.step), run.group)


@dataclass
class _Load:
    """One call of `load`: what it was asked, and the snapshots it passed over on the way."""

    state_dict: dict[str, Any]
    job: str
    step: int | None
    url: str  # this rank's store
    strict: bool
    central: bool
    path: str | None
    concurrency: int
    group: world.Group
    atomic: bool
    bd: Breakdown = field(default_factory=Breakdown)
    started: float = field(default_factory=time.perf_counter)
    skipped: list[dict[str, Any]] = field(
        default_factory=list
    )  # snapshots that could not be read, newest first
    first_error: BaseException | None = None  # the newest one's error

    def skip(self, step: int, why: str, error: BaseException) -> None:
        self.skipped.append({"step": step, "error": why})
        self.first_error = self.first_error or error

    def exhausted(self, no_more: StateError) -> tuple[str, BaseException]:
        """No (older) snapshot to choose (`no_more` says why): the reason to give the durable tier, and the
        error to raise without one: the first snapshot's (never NoSnapshotError when one was there but
        unreadable: a job does not start over from nothing)."""
        if self.first_error is None:
            return str(no_more), no_more
        return "; ".join(f"step {x['step']}: {x['error']}" for x in self.skipped), self.first_error

    def fallback(self, reason: str, error: BaseException) -> LoadInfo:
        """The persisted snapshot at `path`, else `error`; when nothing is persisted there yet, the stores'
        answer (`error`) stands."""
        if self.path is None:
            raise error
        with self.bd.phase("durable"):
            try:
                info = load_durable(
                    self.state_dict, self.path, strict=self.strict, started=self.started, reason=reason,
                    process_group=self.group,
                )  # fmt: skip
            except NoSnapshotError:
                raise error from None
        info.phases, info.skipped = self.bd.as_dict(), self.skipped
        return info


@dataclass
class _Turn:
    """What rank 0 tells every rank to load: a snapshot, what the target takes of it and the plan's
    figures (each rank's own part of the plan travels beside it, `fetch.ways`)."""

    step: int
    save_id: str | None
    values: dict[str, Any]  # the snapshot's plain values that some rank's target has
    missing: list[str]
    unexpected: list[str]
    why: dict[str, str]  # every lost store, those a replica serves included
    remap: dict[str, str]  # lost stores whose blobs a replica serves
    plan_bytes: dict[str, int]
    stores: list[str]  # every rank's store, in rank order
    hub: str | None  # central: the store every read goes through
    skipped: list[dict[str, Any]]  # snapshots passed over, newest first
    spent: dict[str, float]  # rank 0's seconds choosing and planning this turn


@dataclass
class _Stop:
    """No snapshot in the stores can serve the load: the durable tier with `reason`, else `error`."""

    reason: str
    error: BaseException
    skipped: list[dict[str, Any]]
    spent: dict[str, float]


class _Planner:
    """Rank 0's part of a load: it chooses the snapshot for every rank and plans every rank's reads of it,
    once. Why not every rank: each would plan the whole job and unpickle the whole snapshot's PTC, and
    with many ranks on few cores that repeated work was the load's fixed cost (`benchmarks/bench_small.py`
    at 16 ranks)."""

    def __init__(self, run: _Load, sources: list[str]) -> None:
        self.run, self.sources = run, sources
        self.layouts: list[RankShards] = []
        self.urls: list[str] = []
        self.new: PTC | None = None
        self.wanted: dict[str, Any] = {}
        self.spent = Breakdown()  # this turn's

    def first(self, layouts: list[RankShards]) -> world.Dealt:
        """From every rank's shards (gathered): the target layout, then the newest readable snapshot."""
        self.layouts, self.urls = layouts, _stores(layouts, self.run.url, self.sources)
        self.spent = Breakdown()
        with self.spent.phase("plan"):
            self.new, self.wanted = build_ptc(layouts), merged_values(layouts)
        return self._turn(None)

    def next(self, below: int) -> world.Dealt:
        """The snapshot before `below`, as every rank failed to read that one."""
        self.spent = Breakdown()
        return self._turn(below)

    def _turn(self, below: int | None) -> world.Dealt:
        run = self.run
        while True:
            with self.spent.phase("choose"):
                snap = _choose(run.job, run.step, self.urls, below)
            if isinstance(snap, StateError):
                return self._stop(*run.exhausted(snap))
            with self.spent.phase("plan"):
                p = _plan(snap, self.new, self.wanted, run.strict)
            if p.complete:
                return self._deal(snap, p)
            # lost stores took pieces no copy holds (a save torn by a host's death reads as complete while
            # that host's store cannot answer): the persisted snapshot if one is named, else the snapshot
            # before this one, unless this step was asked for
            gone = UnrecoverableError([(t, str(b)) for t, b in p.unrecoverable])
            if run.step is not None or run.path is not None:
                return self._stop("unrecoverable", gone)
            run.skip(snap.step, f"{gone} (stores lost: {', '.join(snap.lost)})", gone)
            below = snap.step

    def _stop(self, reason: str, error: BaseException) -> world.Dealt:
        stop = _Stop(reason, error, list(self.run.skipped), self.spent.as_dict())
        return stop, [None] * len(self.layouts)

    def _deal(self, snap: Snapshot, p: Plan) -> world.Dealt:
        run, new = self.run, self.new
        assert new is not None
        with self.spent.phase("plan"):
            hosts = new.mesh.hosts
            shared = {h: shared_remote_boxes(p, h, every=run.atomic) for h in set(hosts)}
            parts = [ways(p, snap.view, r, shared[url]) for r, url in enumerate(hosts)]
            missing, unexpected = _differences(snap.ptc, new, self.wanted)
            s = p.stats
        turn = _Turn(
            snap.step,
            snap.manifest.get("save_id"),
            {k: v for k, v in snap.ptc.values.items() if k in self.wanted},
            missing,
            unexpected,
            dict(snap.why),
            dict(snap.remap),
            {"kept": s.kept, "same_host": s.same_host, "relayed": s.relayed,
             "cross_host": s.cross_host, "cross_host_lower_bound": s.cross_host_lower_bound},
            list(hosts),
            snap.view.mesh.hosts[0] if run.central else None,
            list(run.skipped),
            self.spent.as_dict(),
        )  # fmt: skip
        return turn, parts


def _choose(job: str, step: int | None, urls: list[str], below: int | None) -> Snapshot | StateError:
    """The snapshot to read, or why there is none (a value: every rank takes it as the answer)."""
    try:
        return choose(job, step, urls, below=below)
    except StateError as e:
        return e


def _stores(layouts: list[RankShards], url: str, sources: list[str]) -> list[str]:
    """Where to look for the snapshot: this rank's store first, then every rank's and the `sources`."""
    return sorted({lay.store for lay in layouts} | {resolve(s) for s in sources}, key=lambda u: u != url)


def _plan(snap: Snapshot, new: PTC | None, wanted: dict[str, Any], strict: bool) -> Plan:
    """The plan from the snapshot (its lost stores' ranks served by replicas) to the target, over the
    tensors both have."""
    assert new is not None
    common = _check_keys(snap.ptc, new, wanted, strict)
    return plan(subset(snap.view, common), subset(new, common), lost=snap.lost)


def _read(turn: _Turn, part: Ways, shards: dict[str, LocalShard], run: _Load) -> tuple[Failed | None, dict]:
    """This rank's boxes read and verified, the ranks' outcomes agreed on, then (when every rank's boxes
    arrived) the targets written; what failed where otherwise, with nothing written; and the bytes moved."""
    at, me = Version(run.job, turn.step, turn.save_id), world.rank(run.group)
    reads: list[Read] = []

    def read() -> None:
        reads.extend(reads_of(part, me, run.url, shards, turn.hub))
        held.read(reads)

    with HeldBoxes(shards, at, run.concurrency, run.bd, run.atomic) as held:  # let go of on any way out
        error = attempt(read)
        with run.bd.phase("barrier"):  # every rank's status: the wait for the slowest rank
            failed = agree(error, run.group)
        with run.bd.phase("drop_relays"):
            drop_relays(run.job, turn.step, run.url, turn.stores, me)
        if failed is None:
            with run.bd.phase("write"):  # every box of every rank arrived and verified
                held.write()
                held.release()
    return failed, moved_bytes([r.fetch for r in reads], shards, run.central)


def _after_failure(failed: Failed, step: int, run: _Load) -> LoadInfo | None:
    """Nothing was written (an atomic load); every rank takes the same way out: raise (a bug, not the
    stores' fault), the durable tier (this step was asked for), or the snapshot before this one (None)."""
    error = failed.raised("load the snapshot")
    if not failed.stores_only:  # no fallback hides a bug
        raise error
    if not run.atomic and not run.strict:  # what would take over may lack a tensor this attempt part wrote
        raise error
    reason = f"reading the snapshot failed on rank {failed.first.rank}: {failed.first.why}"
    if run.step is not None:  # the caller asked for this step: no other one is the answer
        return run.fallback(reason, error)
    run.skip(step, reason, error)
    return None


def _loaded(turn: _Turn, moved: dict[str, int], tree: Any, values: dict[str, Any], run: _Load) -> LoadInfo:
    with run.bd.phase("restore"):
        restore(run.state_dict, tree, {k: v for k, v in turn.values.items() if k in values})
    return LoadInfo(
        run.job,
        turn.step,
        time.perf_counter() - run.started,
        moved,
        turn.missing,
        turn.unexpected,
        sorted(turn.why),  # every lost store, those a replica served (`replaced`) included
        phases=run.bd.as_dict(),
        lost_why=dict(turn.why),
        replaced=dict(turn.remap),
        skipped=run.skipped,
        plan_bytes=turn.plan_bytes,
    )


def _differences(old: PTC, new: PTC, values: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Names the target wants but the snapshot lacks, and names the snapshot has but the target lacks."""
    target, saved = set(new.tensors) | set(values), set(old.tensors) | set(old.values)
    return sorted(target - saved), sorted(saved - target)


def _check_keys(old: PTC, new: PTC, values: dict[str, Any], strict: bool) -> set[str]:
    missing, unexpected = _differences(old, new, values)
    kinds = sorted((set(new.tensors) & set(old.values)) | (set(values) & set(old.tensors)))
    if kinds:
        raise ShapeMismatchError(f"{kinds[0]!r} is a tensor on one side and a plain value on the other")
    if strict and (missing or unexpected):
        raise KeyMismatchError(missing, unexpected)
    common = set(old.tensors) & set(new.tensors)
    for name in sorted(common):
        a, b = old.tensors[name], new.tensors[name]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            raise ShapeMismatchError(
                f"tensor {name!r} is {a.dtype}{list(a.shape)} in the snapshot but {b.dtype}{list(b.shape)} "
                "in the target"
            )
    return common
