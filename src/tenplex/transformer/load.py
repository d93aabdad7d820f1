"""`tenplex.load`: each rank computes its part of the plan from the chosen snapshot and pulls its boxes.

Orchestration only: the target's shards are gathered (`gathered`), one rank chooses the snapshot for all
(`snapshot`), every rank plans, `fetch` moves the bytes, and `durable` takes over when memory cannot serve.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from ..planner import plan
from ..ptc import PTC
from ..util import collector, env
from . import world
from .breakdown import Breakdown
from .durable import load_durable
from .errors import KeyMismatchError, NoSnapshotError, ShapeMismatchError, StateError, UnrecoverableError
from .fetch import drop_relays, execute, shared_remote_boxes
from .gathered import build_ptc, gather, merged_values, subset
from .shards import local_shard
from .snapshot import LoadInfo, choose
from .stores import resolve
from .tree import expand, flatten, restore


@collector.paused()
def load(
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
) -> LoadInfo:
    """Fill `state_dict` in place from version `step` (default: the newest committed) of `job`.

    The target layout is whatever the tensors handed in are. `central=True` routes every byte through
    one host's store (the paper's Tenplex-Central baseline). `path` names a persisted DCP snapshot to fall
    back to when the stores cannot serve the snapshot. `process_group`: the ranks of the job.
    `sources`: more stores to look for the snapshot in (default $TENPLEX_SOURCES, comma-separated) — the
    old hosts' stores when the job moved to new hosts; the ranks' own stores are always searched.
    Without `step`, a snapshot that cannot be read (bytes that fail their checksums, a blob gone) gives way
    to the newest one before it, then to `path`; `LoadInfo.skipped` lists those passed over, and why.
    """
    started = time.perf_counter()
    bd = Breakdown()
    group = process_group
    skipped: list[dict[str, Any]] = []  # snapshots that could not be read, newest first

    def fallback(reason: str, error: BaseException) -> LoadInfo:
        if path is None:
            raise error
        with bd.phase("durable"):
            try:
                info = load_durable(
                    state_dict, path, strict=strict, started=started, reason=reason, process_group=group
                )
            except NoSnapshotError:  # nothing persisted there yet: the stores' answer stands
                raise error from None
        info.phases, info.skipped = bd.as_dict(), skipped
        return info

    url = resolve(store)
    with bd.phase("describe"):
        tree = expand(state_dict)
        tensors, values = flatten(tree)
        shards = {n: local_shard(n, t) for n, t in tensors.items()}
    with bd.phase("gather"):
        layouts = gather(url, shards, values, group)
    with bd.phase("plan"):
        wanted = merged_values(layouts)  # the value names of the whole target job
        new = build_ptc(layouts)
    if sources is None:
        sources = env.url_list(env.SOURCES)
    urls = sorted({lay.store for lay in layouts} | {resolve(s) for s in sources}, key=lambda u: u != url)
    below: int | None = None
    first_error: BaseException | None = None
    while True:  # the newest snapshot; one that cannot be read (a flipped byte) gives way to the one before
        try:
            with bd.phase("choose"):
                snap = world.decide(partial(choose, job, step, urls, below=below), group)
        except StateError as e:  # no (older) snapshot in memory, or the stores cannot say which
            if first_error is None:
                return fallback(str(e), e)
            # no snapshot in memory could be read: the first one's error (never NoSnapshotError, so a job
            # does not start over from nothing)
            return fallback("; ".join(f"step {x['step']}: {x['error']}" for x in skipped), first_error)
        with bd.phase("plan"):
            old = snap.ptc
            common = _check_keys(old, new, wanted, strict)
            old_view = snap.view
            p = plan(subset(old_view, common), subset(new, common), lost=snap.lost)
        if not p.complete:  # lost stores took pieces no copy holds (a save torn by a host's death reads
            # as complete while that host's store cannot answer): the persisted snapshot if one is named,
            # else the snapshot before this one, unless this step was asked for
            gone = UnrecoverableError([(t, str(b)) for t, b in p.unrecoverable])
            if step is not None or path is not None:
                return fallback("unrecoverable", gone)
            skipped.append({"step": snap.step, "error": f"{gone} (stores lost: {', '.join(snap.lost)})"})
            first_error, below = first_error or gone, snap.step
            continue
        me = world.rank(group)
        with bd.phase("plan"):
            shared = shared_remote_boxes(p, new.mesh.hosts[me])
        moved, write, release, failure = {}, None, None, None
        try:
            moved, write, release = execute(
                p.for_rank(me), shards, job, snap.step, old_view, url, central, concurrency, shared, bd,
                snap.manifest.get("save_id"),
            )  # fmt: skip
        except Exception as e:  # every rank learns of it below, so none waits for the others forever
            failure = e
        try:
            with bd.phase("barrier"):  # every rank's status: the wait for the slowest rank
                statuses = world.all_gather(_describe(failure), group)
        except BaseException:  # the group broke: nothing will be written from the held boxes
            if release is not None:
                release()
            raise
        failed = [(r, f) for r, f in enumerate(statuses) if f is not None]
        with bd.phase("drop_relays"):
            drop_relays(job, snap.step, url, [lay.store for lay in layouts], me)
        if not failed:
            break
        if release is not None:  # nothing is written from this snapshot: its held boxes go
            release()
        # nothing was written; every rank takes the same way out: an older snapshot, the fallback, or raise
        r, (_, why) = failed[0]
        error = failure or StateError(f"rank {r} could not load the snapshot: {why}")
        if not all(ok for _, (ok, _) in failed):  # not the stores' fault (a bug): no fallback hides it
            raise error
        reason = f"reading the snapshot failed on rank {r}: {why}"
        if step is not None:  # the caller asked for this step: no other one is the answer
            return fallback(reason, error)
        skipped.append({"step": snap.step, "error": reason})
        first_error, below = first_error or error, snap.step
    with bd.phase("write"):  # every box of every rank arrived and verified: now the targets are written
        try:
            if write is not None:
                write()
        finally:
            if release is not None:
                release()
    with bd.phase("restore"):
        restore(state_dict, tree, {k: v for k, v in old.values.items() if k in values})
    missing, unexpected = _differences(old, new, wanted)
    s = p.stats
    return LoadInfo(
        job,
        snap.step,
        time.perf_counter() - started,
        moved,
        missing,
        unexpected,
        sorted(snap.why),  # every lost store, those a replica served (`replaced`) included
        phases=bd.as_dict(),
        lost_why=dict(snap.why),
        replaced=dict(snap.remap),
        skipped=skipped,
        plan_bytes={"kept": s.kept, "same_host": s.same_host, "relayed": s.relayed,
                    "cross_host": s.cross_host, "cross_host_lower_bound": s.cross_host_lower_bound},
    )  # fmt: skip


def _describe(error: BaseException | None) -> tuple[bool, str] | None:
    """What the other ranks learn of a rank's failed reads: whether a fallback may serve, and why."""
    return None if error is None else (isinstance(error, StateError), f"{type(error).__name__}: {error}")


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
