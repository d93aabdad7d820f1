"""`tenplex.save`: every rank copies its shards into its host's store; the version commits once all have.

One replica per host is written (the lowest rank on that host holding the piece), so replicas on other
hosts stay available for failures and for nearby loads, without storing a host's copy twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..ptc import values as value_codec
from ..store import MemoryLimitError, StoreClient, StoreError
from ..util import collector
from . import world
from .agree import Failed, attempt, settle
from .breakdown import Breakdown
from .commit import commit
from .errors import SaveTimeoutError, StateError
from .gathered import LAYOUTS, blob_name, gather_writers
from .shards import LocalShard, local_shard
from .snapshot import Version, make_manifest
from .staging import StagedSnapshot, stage
from .stores import client, resolve
from .tree import expand, flatten


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


class BackgroundCommits:
    """The commits of asynchronous saves still under way, and per process group the gloo twin they run on.
    Process-wide on purpose: a save returns before its commit ends, and a process's later saves reuse the
    twin; `forget` when the process's world is gone."""

    def __init__(self) -> None:
        self._twins: dict[Any, Any] = {}  # process group -> its gloo twin
        self._pending: set[SaveHandle] = set()

    def group_for(self, group: world.Group) -> world.Group:
        """The twin of `group` (made here, collectively, in the foreground), None without a world."""
        if world.active() and group not in self._twins:
            self._twins[group] = world.background_group(group)
        return self._twins.get(group)

    def start(self, handle: SaveHandle, finish: Callable[[], None]) -> SaveHandle:
        def run() -> None:
            try:
                finish()
            except BaseException as e:  # reported by wait()
                handle._error.append(e)
            finally:
                self._pending.discard(handle)

        handle._thread = threading.Thread(
            target=run, name=f"tenplex-save-{handle.job}-{handle.step}", daemon=True
        )
        self._pending.add(handle)
        handle._thread.start()
        return handle

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for handle in list(self._pending):
            if handle._thread is not None:
                handle._thread.join(max(0.0, deadline - time.monotonic()))
        return all(h.done for h in self._pending)

    def forget(self) -> None:
        self._twins.clear()
        self._pending.clear()  # a commit under way belongs to that world: a new round never waits for it


COMMITS = BackgroundCommits()


def forget_groups() -> None:
    """Drop what this process keeps per process group: a process that runs a rank of another layout next
    has a new default group, and the old groups' gloo twins belong to a world that is gone."""
    COMMITS.forget()
    LAYOUTS.clear()


def wait_for_pending(timeout: float) -> bool:
    """Let the commits of asynchronous saves finish (up to `timeout` s in all), e.g. before exiting on
    SIGTERM, so that no version ends up committed on some stores and not on others. True if none is left."""
    return COMMITS.wait(timeout)


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
    group = COMMITS.group_for(process_group) if async_save else process_group
    with bd.phase("describe"):
        shards, values = _describe(state_dict)
    # the writers' layout is built only for a new one
    found, merged, save_id = gather_writers(url, shards, values, process_group, bd)
    me = world.rank(process_group)
    mine = sorted(found.mine(me))
    with bd.phase("stage"):  # host copies: an asynchronous save writes them to the store in the background
        host = stage({n: shards[n].local for n in mine}, copy_cpu=async_save)
    at = Version(job, step, save_id)
    copy = _Copy(client(url), at, [(blob_name(me, n), n, shards[n].dtype) for n in mine], host, bd)
    if not async_save:
        copy.run()
    written = sum(shards[n].box.volume * found.ptc.tensors[n].itemsize for n in mine)
    handle = SaveHandle(job, step, written, time.perf_counter() - started, bd, save_id)
    manifest = make_manifest(job, step, found.ptc, layout=found.layout, values=merged, save_id=save_id)
    rest = _Commit(handle, copy, manifest, found.blobs, keep, group, me)
    if async_save:
        return COMMITS.start(handle, rest.finish)
    rest.finish()
    return handle


def _describe(state_dict: dict[str, Any]) -> tuple[dict[str, LocalShard], dict[str, Any]]:
    """This rank's shards and values; a value the manifest cannot hold is refused before anything is sent."""
    tensors, values = flatten(expand(state_dict))
    for name, v in values.items():
        try:
            value_codec.encode(v, name)
        except Exception as e:
            raise StateError(str(e)) from None
    return {n: local_shard(n, t) for n, t in tensors.items()}, values


@dataclass
class _Copy:
    """This rank's part of a save: its shards from the host copies into its store, in a version opened
    under the save's id (shared memory copied and checksummed chunk by chunk in one pass, or the network)."""

    own: StoreClient
    at: Version
    items: list[tuple[str, str, str]]  # (blob, tensor, dtype)
    host: StagedSnapshot
    bd: Breakdown
    done: bool = False
    error: Exception | None = None  # a full store, say: raised on every rank after the barrier, not here

    def run(self) -> None:
        if not self.done:
            self.done, self.error = True, attempt(self._write)

    def _write(self) -> None:
        at = self.at
        try:
            with self.bd.phase("create"):
                self.own.create_version(at.job, at.step, at.save_id)
            with self.bd.phase("copy"):
                blobs = [(blob, self.host.array(n), dtype) for blob, n, dtype in self.items]
                self.own.write_blobs(at.job, at.step, blobs, at.save_id)
        finally:
            self.host.release()

    def abandon(self) -> None:
        """This save's open version out of this rank's store: its memory back for the next save (the step's
        committed save, if it had one, and the copies stay)."""
        try:
            self.own.delete_version(self.at.job, self.at.step, self.at.save_id)
        except StoreError:  # another rank of this host deleted it first, or the store is gone
            pass


@dataclass
class _Commit:
    """The rest of a save once its host copies are taken: the copy into the store (an asynchronous save's,
    here), the ranks' agreement, rank 0's commit, and the agreement on that."""

    handle: SaveHandle
    copy: _Copy
    manifest: dict[str, Any]
    blobs: dict[str, list[str]]  # store -> the blobs it must hold
    keep: int | None
    group: world.Group
    me: int

    def finish(self) -> None:
        bd = self.handle.breakdown
        self.copy.run()
        before, t = bd.as_dict(), time.perf_counter()  # every rank's copy, then rank 0's commit
        settled = settle(self.copy.error, self._commit, self.group)  # `settle` runs it on rank 0 only
        committing = sum(bd.as_dict().get(k, 0.0) - before.get(k, 0.0) for k in ("commit", "retain"))
        bd.add("barrier", time.perf_counter() - t - committing)  # the wait: rank 0's commit is its own phase
        if settled.failed is not None:
            if not settled.ran:  # a copy failed: nothing was committed
                self.copy.abandon()
            self._raise(settled.failed)

    def _commit(self) -> None:
        self.handle.replication.update(commit(self.manifest, self.blobs, self.keep, self.handle.breakdown))

    def _raise(self, failed: Failed) -> NoReturn:
        """Every rank raises the same kind of error: the first failed rank its own, the others
        `MemoryLimitError` for a full store, else `StateError`."""
        if failed.mine is not None and failed.mine_first:
            raise failed.mine
        first = failed.first
        cls = MemoryLimitError if first.kind == MemoryLimitError.kind else StateError
        job, step = self.handle.job, self.handle.step
        raise cls(
            f"the snapshot of {job!r} at step {step} was not saved: rank {first.rank}: {first.why}"
        ) from (failed.mine)
