"""One rank's side of an elastic job, for any training script: resume, when to stop, snapshots, records.

`tenplex run --script train.py` starts the script on every rank of every phase and hands it a
`WorkerSpec` (job name, the step to stop at, the snapshot interval, where records go, the stop file, this
rank's store); under torchrun or alone the same script takes those from its arguments. The reference
workload's rank is such a script too. Nothing here imports the reference workload.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..ptc import TenplexError
from ..store import MemoryLimitError, StoreError
from ..transformer import NoSnapshotError, SaveHandle, StoresLostError, jobrecord, load, save
from ..transformer.errors import SaveTimeoutError
from ..transformer.stores import client, resolve
from ..transformer.world import decide, init_distributed
from ..util import env
from . import rounds
from .control import from_every_rank, rank_channel, stop_requested, sum_over_ranks
from .durable_tier import persisted
from .record_types import (
    Done,
    Fresh,
    Loaded,
    Ready,
    Samples,
    Saved,
    SaveFailed,
    Settings,
    Snapshot,
    Step,
    StoreFull,
    Unreplicated,
    Waiting,
)
from .records import Record, Records
from .spec import OPEN_END, WorkerSpec, job_name

State = dict[str, Any] | Callable[[], dict[str, Any]]


class JobError(TenplexError):
    """The job was set up wrongly (no name, no step to stop at)."""


class RoundBrokenError(JobError):
    """The round this rank trains in broke (its agent says so: a host was lost, a worker failed)."""


def _job_end(spec: WorkerSpec | None, until: int | None) -> int:
    """The step this process stops at: the spec's (the phase's end), or the script's own `until` when
    that comes first and the run named no step count; alone, the script's own."""
    limit = spec.until if spec else until
    if spec is not None and spec.steps is None and until is not None:
        limit = min(spec.until, until)
    if limit is None or limit >= OPEN_END:
        raise JobError(
            "say at which step the job ends: ElasticJob(..., until=STEPS) (or tenplex run --steps)"
        )
    return int(limit)


def _overridden(spec: WorkerSpec, until: int | None, every: int | None) -> list[str]:
    """The script's own settings the command line replaced with other values, in its words."""
    out = []
    if spec.steps is not None and until is not None and until != spec.steps:
        out.append(f"--steps {spec.steps} (the script's until={until})")
    if spec.snapshot_every is not None and every is not None and every != spec.snapshot_every:
        out.append(f"--snapshot-every {spec.snapshot_every} (the script's snapshot_every={every})")
    return out


class PhaseCancelled(SystemExit):
    """This phase was started ahead and will not run (the one before it ended otherwise than planned): the
    script ends here, cleanly (exit code 0), having loaded and trained nothing."""

    def __init__(self) -> None:
        super().__init__(0)


class ElasticJob:
    """What a rank needs to take part in an elastic job; every rank makes the same calls in the same order.

    job = ElasticJob(until=1000)            # `tenplex run --steps/--snapshot-every`, when given, win
    step = job.resume(state)                 # the newest snapshot, loaded in place (0: a fresh start)
    while job.running(step):                 # False at the phase's last step, or once asked to stop
        ...; step += 1
        job.step_done(step, state, loss=loss)  # records the step, snapshots every K steps
    job.finish(state, step)                  # the final save the next layout loads from
    """

    def __init__(  # noqa: PLR0913 - the public constructor: every argument a keyword with a default
        self,
        name: str | None = None,
        *,
        until: int | None = None,
        snapshot_every: int | None = None,
        out: str | None = None,
        stop_file: str | None = None,
        durable: str | None = None,
        device: str = "auto",
        keep: int = 3,
        fresh: bool = False,
        spec: WorkerSpec | None = None,
    ) -> None:
        spec = spec or WorkerSpec.from_env()  # under `tenplex run`, the runtime's settings win
        self.spec = spec
        self.name = (spec.job if spec else None) or name or job_name()
        if not self.name:
            raise JobError("name the job: ElasticJob('my-job'), $TENPLEX_JOB, or run it under `tenplex run`")
        self.until = _job_end(spec, until)
        every = snapshot_every if spec is None or spec.snapshot_every is None else spec.snapshot_every
        self.every = int(every or 0)
        self.stop_file = spec.stop_file if spec else stop_file
        self.channel = rank_channel(spec)  # the runtime's signals: stop, turn, fired (None: no runtime)
        self.durable = spec.durable if spec else durable
        self.store = spec.store if spec else None  # None: the transformer's default ($TENPLEX_STORE)
        self.sources = (spec.sources if spec else None) or None  # None: the transformer finds them
        self.keep = keep
        # start over even when stores that may hold a snapshot are lost (`tenplex run --fresh`)
        self.fresh = bool(spec.fresh if spec else fresh) or env.flag(env.FRESH)
        self._init_at, t = time.time(), time.perf_counter()
        init_distributed(device)
        self._group_seconds = time.perf_counter() - t
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # what the phase runs, as the live view, the table and the plot name it: the layout the runtime
        # chose (the reference workload), else the one the script reports in `ready`, else the world size
        self.label = str(spec.layout) if spec and spec.layout else f"world{self.world}"
        self.out = rounds.records_dir(spec.out if spec else out)
        self.records = Records(Path(self.out) / "worker.jsonl") if self.out and self.rank == 0 else None
        self._ledger: Records | None = None
        if spec is not None:  # what the job runs by: the run's end and, said once, what the command line set
            steps = until if spec.steps is None else spec.steps
            self.record(Settings(steps, self.every, _overridden(spec, until, snapshot_every)))
        self.saved = -1  # the newest step this job committed that this process knows of
        self._saved_id: str | None = None  # that save's id (None: loaded, or unknown)
        self.resumed = False  # whether `resume` loaded a snapshot
        self._pending: SaveHandle | None = None
        self._ready = False
        self._started = self._last = time.perf_counter()
        self._load_seconds = 0.0
        self._turn: bool | None = None  # started ahead: whether this phase runs (None: not asked yet)
        self._go_at = 0.0  # when this rank was told to go (started ahead)

    def record(self, record: Record, **extra: Any) -> None:
        """A record for the controller (rank 0 writes; the others have nothing to add)."""
        if self.records is not None:
            self.records.write(record, **extra)

    def samples(self, step: int, dp_rank: int, ids: list[int]) -> None:
        """The data ledger: the sample ids data-parallel rank `dp_rank` trained on in `step` (call it on one
        rank per dp rank). With `ready(..., sampler=sampler.state_dict())` the runtime checks, after the
        run, that every global batch was the seeded one and no sample came twice in an epoch."""
        if self.out is None:
            return
        if self._ledger is None:
            self._ledger = Records(Path(self.out) / f"ledger-dp{dp_rank}.jsonl")
        self._ledger.write(Samples(step, dp_rank, list(ids)))

    @property
    def ahead(self) -> bool:
        """Whether this phase was started ahead, while the one before it still trained (by `tenplex run`,
        or handed ahead by an agent)."""
        return bool(self.spec and self.spec.ahead) or rounds.ahead()

    def wait_turn(self) -> bool:
        """A phase started ahead waits here (built, nothing loaded) until the one before it committed its
        final save (True) or ended otherwise (False: this phase will not run; the controller says which).
        Other phases go at once. `resume` calls it; call it earlier to overlap more with the old layout."""
        if self._turn is None:
            self._turn = True
            if self.ahead and self.channel is not None:
                self.record(Waiting(time.time() - self._init_at))  # built this long after start
                self._turn, told = self.channel.wait_turn()
                # told when the turn was given: a rank that was still building then sees it late, and
                # that wait is build, not go
                self._go_at = min(time.time(), told) if self._turn else time.time()
        return self._turn

    def resume(self, state: State) -> int:
        """Load the newest committed snapshot into `state` in place; its step, or 0 when there is none.
        `state` may be a `tenplex.integrations.TrainState` (anything with `restore` and `start_fresh`):
        then the loaded state is handed back to the model and optimizer, and a fresh start leaves the
        optimizer as fresh as in the script without tenplex. A phase started ahead first waits for its
        turn (`wait_turn`); cancelled, it raises PhaseCancelled."""
        if not self.wait_turn():
            raise PhaseCancelled()
        current = _state(state)
        self.resumed = False
        step = self._load(current)
        if self.resumed and hasattr(state, "restore"):
            state.restore(current)
        elif not self.resumed and hasattr(state, "start_fresh"):
            state.start_fresh()
        return step

    def _load(self, state: dict[str, Any]) -> int:
        """The load and its record: the snapshot's step, 0 for a fresh start."""
        try:
            # an agent's --persist-dir (the same on every rank): rank 0 names its newest checkpoint for all
            path = self.durable or (decide(persisted) if os.environ.get(env.DURABLE) else None)
            info = load(state, job=self.name, path=path, store=self.store, sources=self.sources)
        except NoSnapshotError:  # every store the job used said so: the one way to a fresh start
            self.record(Fresh(0, self.label))
            return 0
        except StoresLostError as e:  # could not ask is not "nothing there": only --fresh starts over
            if not self.fresh:
                raise
            self.record(Fresh(0, self.label, forced=True, lost_stores=e.lost))
            if self.rank == 0:  # the record named the lost stores: this job starts a new one
                jobrecord.forget(self.name)
            return 0
        self._load_seconds, self.resumed = info.seconds, True
        if info.source == "memory":  # loaded from a DCP checkpoint, the stores do not hold this step yet
            self.saved = info.step
        moved = sum_over_ranks(info.bytes)
        self.record(
            Loaded(
                step=info.step,
                seconds=info.seconds,
                bytes=moved,
                source=info.source,
                plan=info.plan_bytes,
                lost_stores=info.lost_stores,
                lost_why=info.lost_why,
                replaced=info.replaced,
                phases=info.phases,
                layout=self.label,
                skipped=info.skipped,
            )
        )
        return info.step

    def ready(self, step: int, *, layout: str | None = None, **fields: Any) -> None:
        """Mark the end of the restart (the downtime the controller reports ends here); `running` calls it
        if the script did not. `layout`: what this script runs, as the run's views should name it (e.g.
        "fsdp3"). The record carries where the restart's time went: `init_at` (the last rank's job object
        made: a rank whose process started late delays them all), `process_group_seconds` (from then to
        the group formed), `load_seconds`, `build_seconds` (the rest: building the model and optimizer),
        `pids`, each rank's process; for a phase started ahead, `go_at` (the last rank told to go) and
        `build_seconds` counted from then (what was built before is not part of the restart). A phase
        started ahead waits for its turn here if it did not yet (PhaseCancelled when cancelled)."""
        if not self.wait_turn():
            raise PhaseCancelled()
        if not self._ready:
            self._ready = True
            every = from_every_rank(self._init_at, os.getpid(), self._go_at)
            last = max(init for init, _, _ in every)
            group = max(0.0, self._init_at + self._group_seconds - last)
            go_at = max(go for _, _, go in every)
            began = go_at if self.ahead else last + group
            self.label = layout or self.label
            ahead = {"ahead": True, "go_at": go_at} if self.ahead else {}
            self.record(
                Ready(
                    step=step,
                    init_at=last,
                    process_group_seconds=group,
                    load_seconds=self._load_seconds,
                    build_seconds=time.time() - began - self._load_seconds,
                    layout=self.label,
                    pid=os.getpid(),
                    pids=[
                        int(pid) for _, pid, _ in every
                    ],  # each rank's process (a spare may serve many phases)
                    world=self.world,
                    **ahead,
                ),
                **fields,
            )
            if self.rank == 0:
                rounds.mark_ready(self.name)
            self._last = time.perf_counter()

    def running(self, step: int) -> bool:
        """Whether to train step `step + 1`: all ranks get the same answer (one all-reduce)."""
        self.ready(step)
        going = not stop_requested(self.stop_file, self.channel, step) and step < self.until
        if not going:
            rounds.note_end(step >= self.until)
        return going

    def step_done(self, step: int, state: State, *, loss: float, **metrics: Any) -> None:
        """Record the step; every `snapshot_every` steps snapshot `state` asynchronously (the step waits only
        for the local copy). `state` may be a function that builds the state dict."""
        now = time.perf_counter()
        metrics.setdefault("step_time", now - self._last)
        self._last = now
        self.record(Step(step, float(loss)), **metrics)
        if self.spec and step in self.spec.failures and self.channel is not None:  # before this step's
            # snapshot: it cannot commit then, so every run replays the same steps; the killed ranks die
            # here, the others go on into collectives whose peers are gone, as after any failure
            self.channel.await_fired(step, FAILURE_WAIT_S)
        if self.every and step % self.every == 0 and step < self.until:
            self._wait_pending()
            t = time.perf_counter()
            self._pending = save(
                _state(state), job=self.name, step=step, store=self.store, async_save=True, keep=self.keep
            )
            self.record(Snapshot(step, time.perf_counter() - t, "async"))

    def _wait_pending(self) -> None:
        """The snapshot in flight committed (the newest this job saved), or was skipped because it did not
        fit in the stores (every rank learns that from the save): training goes on (`_no_room`)."""
        handle, self._pending = self._pending, None
        if handle is None:
            return
        try:
            self._wait_commit(handle)
        except MemoryLimitError as e:
            self._no_room(handle.step, e, skipped=True)
            return
        self.saved, self._saved_id = handle.step, handle.save_id
        self._report_copies(handle)

    def _wait_commit(self, handle: SaveHandle) -> None:
        """Until the commit ended; a commit that waits on ranks of a round that broke (a host was lost)
        may never end, as gloo cannot abort its collective: this rank leaves the round instead."""
        while True:
            try:
                handle.wait(COMMIT_POLL_S)
                return
            except SaveTimeoutError:
                if self.channel is not None and self.channel.broken():
                    raise RoundBrokenError(
                        f"the round broke while step {handle.step}'s snapshot committed"
                    ) from None

    def _report_copies(self, handle: SaveHandle) -> None:
        """A committed save whose copies did not reach a replica store is said in the records (rank 0
        commits, so it knows): a lost host may take its shards with it until the next save's copies land."""
        if not handle.replicated:
            self.record(Unreplicated(handle.step, handle.replication))

    def _no_room(self, step: int, error: MemoryLimitError, skipped: bool) -> None:
        """A save did not fit in the stores: said in the records (`store_full`), and from now on the job
        keeps only its newest snapshot, the older ones deleted now (room for the next; the newest complete
        one is never deleted). Every rank calls it at the same point (a collective)."""
        self.record(StoreFull(step, f"{type(error).__name__}: {error}", skipped, keep=1))
        self.keep = 1
        if self.rank == 0:
            for url in dict.fromkeys([resolve(self.store), *(self.sources or [])]):
                try:
                    protect = None if self.saved < 0 else (self.saved, self._saved_id)
                    client(url).retain(self.name, 1, protect=protect)
                except StoreError:  # a store without the job, or gone
                    pass
        dist.barrier()

    def finish(self, state: State, step: int) -> None:
        """Wait for snapshots in flight, save this step (unless already committed), and say done. A final
        save that does not fit is tried once more after the older snapshots made room; then the job ends
        (`save_failed`): the next layout could only go back to an older step."""
        self._wait_pending()
        if step == self.saved:  # loaded at this step, or snapshotted at it: that version holds this state
            self.record(Saved(step, 0.0, 0, already=True))
        else:
            t = time.perf_counter()
            try:
                h = save(_state(state), job=self.name, step=step, store=self.store, keep=self.keep)
            except MemoryLimitError as e:
                self._no_room(step, e, skipped=False)
                try:
                    h = save(_state(state), job=self.name, step=step, store=self.store, keep=self.keep)
                except MemoryLimitError as again:
                    self.record(SaveFailed(step, f"{type(again).__name__}: {again}"))
                    raise
            self.saved, self._saved_id = step, h.save_id
            self._report_copies(h)
            self.record(Saved(step, time.perf_counter() - t, h.bytes_written, phases=h.phases))
        self._hand_over()
        self.record(Done(step))
        dist.barrier()

    def _hand_over(self) -> None:
        """The final save committed: the phase started ahead after this one (if the runtime named one)
        may go now, not once this process has torn its round down. Under `tenplex run` rank 0 says so
        (one controller); under agents every rank, each to its own host's agent."""
        controlled = self.rank == 0 and self.spec is not None and self.spec.control
        if self.channel is not None and (controlled or rounds.worker_agent() is not None):
            self.channel.hand_over()


def _state(state: State) -> dict[str, Any]:
    return state() if callable(state) else state


COMMIT_POLL_S = 0.1  # a rank waiting for a commit asks this often whether its round broke
FAILURE_WAIT_S = 120.0  # a controller that never fires the failure it announced: the rank ends with an error
