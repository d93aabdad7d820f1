"""`tenplex.load`: each rank computes its part of the plan from the chosen snapshot and pulls its boxes.

Orchestration only, over the three roles: the target's shards are gathered (`gathered`), one rank chooses
the snapshot for all (`snapshot`), every rank plans (`planner`), the executor (`fetch`) moves the bytes, the
ranks `agree` on the outcome, and `durable` takes over when memory cannot serve.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..planner import Fetch, Plan, plan
from ..ptc import PTC
from ..util import collector, env
from . import world
from .agree import Failed, agree, attempt
from .breakdown import Breakdown
from .durable import load_durable
from .errors import KeyMismatchError, NoSnapshotError, ShapeMismatchError, StateError, UnrecoverableError
from .fetch import HeldBoxes, drop_relays, moved_bytes, routes, shared_remote_boxes
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
    target, urls, first = _describe(run, env.url_list(env.SOURCES) if sources is None else sources)
    # newest first: one that cannot be read gives way to the one before
    for snap in run.snapshots(urls, first):
        with run.bd.phase("plan"):
            p = _plan(snap, target, strict)
        if not p.complete:  # lost stores took pieces no copy holds (a save torn by a host's death reads
            # as complete while that host's store cannot answer): the persisted snapshot if one is named,
            # else the snapshot before this one, unless this step was asked for
            gone = UnrecoverableError([(t, str(b)) for t, b in p.unrecoverable])
            if step is not None or path is not None:
                return run.fallback("unrecoverable", gone)
            run.skip(snap.step, f"{gone} (stores lost: {', '.join(snap.lost)})", gone)
            continue
        fetches = p.for_rank(world.rank(run.group))
        failed = _read(snap, p, fetches, target, run)
        if failed is None:
            return _loaded(snap, p, moved_bytes(fetches, snap.view, central), target, run)
        info = _after_failure(failed, snap, run)
        if info is not None:
            return info
    return run.exhausted()


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
    no_more: StateError | None = None  # why no (older) snapshot could be chosen

    def snapshots(self, urls: list[str], first: Snapshot | StateError) -> Iterator[Snapshot]:
        """The newest snapshot (of `step` if asked; `first`, chosen with the target's description), then
        each one before the last one given, chosen by one rank for all; ends, with `no_more` set, when none
        is left in memory or the stores cannot say."""
        snap = first
        while True:
            if isinstance(snap, StateError):
                self.no_more = snap
                return
            yield snap
            with self.bd.phase("choose"):
                snap = world.decide(partial(_choose, self.job, self.step, urls, snap.step), self.group)

    def skip(self, step: int, why: str, error: BaseException) -> None:
        self.skipped.append({"step": step, "error": why})
        self.first_error = self.first_error or error

    def exhausted(self) -> LoadInfo:
        """No (older) snapshot to choose: the durable tier with why, else the first snapshot's error
        (never NoSnapshotError when one was there but unreadable: a job does not start over from nothing)."""
        assert self.no_more is not None
        if self.first_error is None:
            return self.fallback(str(self.no_more), self.no_more)
        return self.fallback(
            "; ".join(f"step {x['step']}: {x['error']}" for x in self.skipped), self.first_error
        )

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
class _Target:
    """The tensors handed to `load`, as every rank described them: the target layout."""

    tree: Any
    values: dict[str, Any]
    shards: dict[str, LocalShard]
    layouts: list[RankShards]  # every rank's shards and values
    wanted: dict[str, Any]  # the value names of the whole target job
    new: PTC


def _describe(run: _Load, sources: list[str]) -> tuple[_Target, list[str], Snapshot | StateError]:
    """The target layout, the stores to search, and the newest snapshot (or why none): every rank's
    shards gathered to rank 0, which chooses the snapshot for all, in one gather and one broadcast."""
    with run.bd.phase("describe"):
        tree = expand(run.state_dict)
        tensors, values = flatten(tree)
        shards = {n: local_shard(n, t) for n, t in tensors.items()}
    mine = describe(run.url, shards, values, run.group)

    def choose_first(layouts: list[RankShards]) -> tuple[list[RankShards], Snapshot | StateError, float]:
        t = time.perf_counter()
        first = _choose(run.job, run.step, _stores(layouts, run.url, sources), None)
        return layouts, first, time.perf_counter() - t

    t = time.perf_counter()
    layouts, first, choosing = world.gather_then(mine, choose_first, run.group)
    run.bd.add("gather", time.perf_counter() - t - choosing)
    run.bd.add("choose", choosing)  # rank 0's, which every rank waits for
    with run.bd.phase("plan"):
        target = _Target(tree, values, shards, layouts, merged_values(layouts), build_ptc(layouts))
    return target, _stores(layouts, run.url, sources), first


def _choose(job: str, step: int | None, urls: list[str], below: int | None) -> Snapshot | StateError:
    """The snapshot to read, or why there is none (a value: every rank takes it as the answer)."""
    try:
        return choose(job, step, urls, below=below)
    except StateError as e:
        return e


def _stores(layouts: list[RankShards], url: str, sources: list[str]) -> list[str]:
    """Where to look for the snapshot: this rank's store first, then every rank's and the `sources`."""
    return sorted({lay.store for lay in layouts} | {resolve(s) for s in sources}, key=lambda u: u != url)


def _plan(snap: Snapshot, target: _Target, strict: bool) -> Plan:
    """The plan from the snapshot (its lost stores' ranks served by replicas) to the target, over the
    tensors both have."""
    common = _check_keys(snap.ptc, target.new, target.wanted, strict)
    return plan(subset(snap.view, common), subset(target.new, common), lost=snap.lost)


def _read(snap: Snapshot, p: Plan, fetches: list[Fetch], target: _Target, run: _Load) -> Failed | None:
    """This rank's boxes read and verified, the ranks' outcomes agreed on, then (when every rank's boxes
    arrived) the targets written; what failed where otherwise, with nothing written."""
    me = world.rank(run.group)
    with run.bd.phase("plan"):
        shared = shared_remote_boxes(p, target.new.mesh.hosts[me], every=run.atomic)
    at = Version(run.job, snap.step, snap.manifest.get("save_id"))
    with HeldBoxes(
        target.shards, at, run.concurrency, run.bd, run.atomic
    ) as held:  # let go of on any way out
        reads = partial(routes, fetches, snap.view, run.url, central=run.central, shared=shared)
        error = attempt(lambda: held.read(reads()))
        with run.bd.phase("barrier"):  # every rank's status: the wait for the slowest rank
            failed = agree(error, run.group)
        with run.bd.phase("drop_relays"):
            drop_relays(run.job, snap.step, run.url, [lay.store for lay in target.layouts], me)
        if failed is None:
            with run.bd.phase("write"):  # every box of every rank arrived and verified
                held.write()
                held.release()
    return failed


def _after_failure(failed: Failed, snap: Snapshot, run: _Load) -> LoadInfo | None:
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
    run.skip(snap.step, reason, error)
    return None


def _loaded(snap: Snapshot, p: Plan, moved: dict[str, int], target: _Target, run: _Load) -> LoadInfo:
    with run.bd.phase("restore"):
        restore(run.state_dict, target.tree, {k: v for k, v in snap.ptc.values.items() if k in target.values})
    missing, unexpected = _differences(snap.ptc, target.new, target.wanted)
    s = p.stats
    return LoadInfo(
        run.job,
        snap.step,
        time.perf_counter() - run.started,
        moved,
        missing,
        unexpected,
        sorted(snap.why),  # every lost store, those a replica served (`replaced`) included
        phases=run.bd.as_dict(),
        lost_why=dict(snap.why),
        replaced=dict(snap.remap),
        skipped=run.skipped,
        plan_bytes={"kept": s.kept, "same_host": s.same_host, "relayed": s.relayed,
                    "cross_host": s.cross_host, "cross_host_lower_bound": s.cross_host_lower_bound},
    )  # fmt: skip


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
