"""`tenplex.save`: every rank copies its shards into its host's store; the version commits once all have.

One replica per host is written (the lowest rank on that host holding the piece), so replicas on other
hosts stay available for failures and for nearby loads, without storing a host's copy twice.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..ptc import values as value_codec
from ..store import MemoryLimitError, StoreClient, StoreError
from ..util import collector, logs
from . import jobrecord, world
from .breakdown import Breakdown
from .errors import SaveTimeoutError, StateError
from .gathered import blob_name, forget_layouts, gather_writers
from .shards import local_shard
from .snapshot import make_manifest, stamp
from .staging import stage
from .stores import client, resolve
from .tree import expand, flatten

log = logs.get("transformer")


@dataclass(eq=False)
class SaveHandle:
    """Returned by `save`; with `async_save=True` the commit finishes in the background: `wait()` for it."""

    job: str
    step: int
    bytes_written: int
    seconds_local: float
    breakdown: Breakdown = field(default_factory=Breakdown)
    save_id: str | None = None
    replication: dict[str, str] = field(default_factory=dict)  # store -> its push: done, failed: …, none
    _thread: threading.Thread | None = None
    _error: list[BaseException] = field(default_factory=list)

    def wait(self, timeout: float | None = None) -> SaveHandle:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise SaveTimeoutError(f"save of {self.job}@{self.step} still running after {timeout} s")
        if self._error:
            raise self._error[0]
        return self

    @property
    def phases(self) -> dict[str, float]:
        """Seconds by phase (describe, create, gather, plan, stage, copy, barrier, commit, retain); the
        commit phases of an asynchronous save appear once it finished."""
        return self.breakdown.as_dict()

    @property
    def replicated(self) -> bool:
        """False when a store's push of this save to its replicas failed or was cancelled (on the rank that
        committed, rank 0, once the commit finished): the save is committed and loadable, but a lost host
        may take its shards with it. A failed push never reads as done."""
        return all(state in ("none", "done") for state in self.replication.values())

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()


_background: dict[Any, Any] = {}  # process group -> its gloo twin for background commits
_pending: set[SaveHandle] = set()  # asynchronous saves whose commit has not finished


def forget_groups() -> None:
    """Drop what this process keeps per process group: a process that runs a rank of another layout next
    has a new default group, and the old groups' gloo twins belong to a world that is gone."""
    _background.clear()
    _pending.clear()  # a commit still under way belongs to that world: a new round never waits for it
    forget_layouts()


def wait_for_pending(timeout: float) -> bool:
    """Let the commits of asynchronous saves finish (up to `timeout` s in all), e.g. before exiting on
    SIGTERM, so that no version ends up committed on some stores and not on others. True if none is left."""
    deadline = time.monotonic() + timeout
    for handle in list(_pending):
        if handle._thread is not None:
            handle._thread.join(max(0.0, deadline - time.monotonic()))
    return all(h.done for h in _pending)


@collector.paused()
def save(
    state_dict: dict[str, Any],
    job: str,
    step: int,
    *,
    store: str | None = None,
    async_save: bool = False,
    keep: int | None = None,
    process_group: world.Group = None,
) -> SaveHandle:
    """Snapshot `state_dict` as version `step` of `job`. Every rank calls it with its own shards.

    Returns once the shards are copied into host buffers when `async_save` (the store writes and the
    commit run in the background), else after the version committed.
    `keep` deletes all but the newest `keep` committed saves afterwards, by commit order, never this one
    (see docs/consistency.md). A push to replicas that failed is in `SaveHandle.replication` and
    `replicated` (and logged); it does not fail the save. `process_group`: the ranks of the job (default:
    all).
    """
    started = time.perf_counter()
    bd = Breakdown()
    url = resolve(store)
    group = process_group
    if async_save and world.active() and group not in _background:
        _background[group] = world.background_group(group)  # collective: created in the foreground
    sync_group = _background.get(group) if async_save else group
    with bd.phase("describe"):
        tensors, values = flatten(expand(state_dict))
        for name, v in values.items():
            try:
                value_codec.encode(v, name)
            except Exception as e:
                raise StateError(str(e)) from None
        shards = {n: local_shard(n, t) for n, t in tensors.items()}
    own = client(url)
    found, merged, save_id = gather_writers(url, shards, values, group, bd)  # built only for a new layout
    ptc, me = found.ptc, world.rank(group)
    mine = found.mine(me)
    written = sum(shards[n].box.volume * ptc.tensors[n].itemsize for n in mine)
    with bd.phase("stage"):  # host copies: an asynchronous save writes them to the store in the background
        host = stage({n: shards[n].local for n in sorted(mine)}, copy_cpu=async_save)

    failed: list[Exception] = []  # this rank's part that failed: every rank learns of it (`_agree`)
    replication: dict[str, str] = {}  # each store's push of this save (rank 0)

    def copy() -> None:
        """Into the store: shared memory copied and checksummed chunk by chunk (one pass), or the network."""
        try:
            with bd.phase("create"):
                own.create_version(job, step, save_id)
            with bd.phase("copy"):
                items = [(blob_name(me, n), host.array(n), shards[n].dtype) for n in sorted(mine)]
                own.write_blobs(job, step, items, save_id)
        except Exception as e:  # a full store, say: raised on every rank after the barrier, not here
            failed.append(e)
        finally:
            host.release()

    if not async_save:
        copy()
    local_seconds = time.perf_counter() - started
    manifest = make_manifest(job, step, ptc, layout=found.layout, values=merged, save_id=save_id)

    def commit() -> None:
        with bd.phase("commit"):
            stamp(manifest)  # each store's replica targets and incarnation
            for url_ in manifest["stores"]:
                info = client(url_).commit(job, step, manifest, wait_replicas=True, blobs=found.blobs[url_])
                replication[url_] = str(info.get("replication", "none"))
            jobrecord.write(manifest)  # on this host: the stores the job's newest snapshot is on
        _warn_unreplicated(job, step, replication)
        # only once committed everywhere: the save named is complete (each store marks it so, and never
        # deletes the newest complete one); without `keep` nothing committed is deleted
        with bd.phase("retain"):
            for url_ in manifest["stores"]:
                client(url_).retain(job, keep, protect=(step, save_id))

    def finish() -> None:
        if async_save:
            copy()
        with bd.phase("barrier"):
            _agree(failed, sync_group, own, job, step, save_id)
        if me == 0:
            try:
                commit()
            except Exception as e:  # raised on every rank at the barrier: none waits for rank 0 there
                failed.append(e)
        with bd.phase("barrier"):
            _agree(failed, sync_group, None, job, step, save_id)

    handle = SaveHandle(job, step, written, local_seconds, bd, save_id, replication)
    if not async_save:
        finish()
        return handle

    def run() -> None:
        try:
            finish()
        except BaseException as e:  # reported by wait()
            handle._error.append(e)
        finally:
            _pending.discard(handle)

    handle._thread = threading.Thread(target=run, name=f"tenplex-save-{job}-{step}", daemon=True)
    _pending.add(handle)
    handle._thread.start()
    return handle


def _agree(
    failed: list[Exception], group: world.Group, own: StoreClient | None, job: str, step: int, save_id: str
) -> None:
    """The barrier of a save, where every rank learns whether every other one's part succeeded: if one
    failed, every rank raises the same kind of error (the first failed rank its own, the others
    `MemoryLimitError` for a full store, else `StateError`), none waits at a later barrier for a rank that
    is gone, and with `own` this save's open version is deleted from this rank's store (its memory back,
    for the next one; the step's committed save, if it had one, and the copies stay)."""
    mine = failed[0] if failed else None
    status = None if mine is None else (getattr(mine, "kind", ""), f"{type(mine).__name__}: {mine}")
    bad = [(r, s) for r, s in enumerate(world.all_gather(status, group)) if s is not None]
    if not bad:
        return
    if own is not None:
        try:
            own.delete_version(job, step, save_id)
        except StoreError:  # another rank of this host deleted it first, or the store is gone
            pass
    r, (kind, why) = bad[0]
    if mine is not None and r == world.rank(group):
        raise mine
    cls = MemoryLimitError if kind == MemoryLimitError.kind else StateError
    raise cls(f"the snapshot of {job!r} at step {step} was not saved: rank {r}: {why}") from mine


def _warn_unreplicated(job: str, step: int, replication: dict[str, str]) -> None:
    for url, state in replication.items():
        if state not in ("none", "done"):
            log.warning("save %s@%d is committed but its copies from %s are not: %s", job, step, url, state)
