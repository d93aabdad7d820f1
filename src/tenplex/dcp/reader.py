"""`StoreReader`: DCP's `StorageReader` on the tensor stores, an adapter onto the roles of `tenplex.load`.

DCP says which ranges every rank needs (its `ReadItem`s); the coordinator hands them to the planner as the
ranks' targets (`layout`), which picks each range's source as it does for `tenplex.load`: the rank's own
device, else the least-loaded replica on its host, else one sender per host and range, relayed by that
host's store to its other ranks, and surviving replicas for lost stores. Each rank runs its part with the
transformer's executor (`HeldBoxes`: shared memory on the same host, the network otherwise, checked against
the chunk digests), the ranks `agree` on the outcome, and only then are the targets written and handed to
DCP's planner, so a load that fails anywhere writes no target.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..planner import Fetch, plan
from ..ptc import PTC
from ..store.keys import check_job, check_step
from ..transformer import world
from ..transformer.agree import agree, attempt
from ..transformer.breakdown import Breakdown
from ..transformer.durable import TORCH_DTYPES
from ..transformer.errors import StateError, UnrecoverableError
from ..transformer.fetch import HeldBoxes, Read, Via, drop_relays, routes, shared_remote_boxes
from ..transformer.gathered import describe, subset
from ..transformer.shards import DTYPES, LocalShard
from ..transformer.snapshot import Snapshot, Version, choose
from ..transformer.stores import resolve
from ..util import env
from .layout import global_box, key, targets, with_bytes
from .location import location
from .metadata import Stored, to_metadata


@dataclass(frozen=True)
class _Part:
    """One rank's part of the global plan, from `prepare_global_plan` to its `read_data`."""

    fetches: list[Fetch]  # what the rank (and its slots) pull, from which old rank
    shared: set[tuple[str, Any, int]]  # the boxes its host's store relays (`shared_remote_boxes`)
    remap: dict[str, str]  # lost stores whose blobs a replica store serves
    stores: list[str]  # every rank's store, in rank order
    rank: int


class StoreReader(StorageReader):
    """Read version `step` (default: the newest complete one) of `job` from the tensor stores.

    A `checkpoint_id` (given here or to `dcp.load`) names the version instead: a step number of `job`, or a
    path mapped to a job and step by `tenplex.dcp.location`, as `StoreWriter` maps it.

    `store`: this rank's store (default $TENPLEX_STORE, else the local default). `sources`: more stores to
    look in (default $TENPLEX_SOURCES, comma-separated), e.g. the old hosts' stores after a move.
    `process_group`: the group given to `dcp.load`, when not the default one (the ranks agree on the
    outcome of their reads before any target is written).
    """

    def __init__(
        self,
        job: str | None = None,
        step: int | None = None,
        *,
        checkpoint_id: str | os.PathLike | int | None = None,
        store: str | None = None,
        sources: list[str] | None = None,
        process_group: world.Group = None,
    ) -> None:
        super().__init__()
        self.job = None if job is None else check_job(job)
        self.step = None if step is None else check_step(step)
        if checkpoint_id is not None:
            self.job, self.step = location(checkpoint_id, self.job)
        self.url = resolve(store)
        if sources is None:
            sources = env.url_list(env.SOURCES)
        self.sources = [resolve(s) for s in sources]
        self.group = process_group
        self.load_id = uuid.uuid4().hex
        self.storage: dict[Any, Stored] = {}
        self._snap: Snapshot | None = None
        self._error: BaseException | None = None
        self._peers: set[str] = set()  # the stores of the other ranks of the load
        self.reads: list[Read] = []  # this rank's reads in the last load, as the executor ran them
        self.relayed = 0  # of those, the ranges taken through this host's relay (fetched once per host)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.job, self.step = location(checkpoint_id, self.job)
        self.load_id = uuid.uuid4().hex
        self._snap, self._error = None, None

    @property
    def chosen_step(self) -> int | None:
        """The step the last `dcp.load` read (after `read_metadata`)."""
        return None if self._snap is None else self._snap.step

    def _urls(self) -> list[str]:
        return sorted({self.url, *self.sources, *self._peers}, key=lambda u: u != self.url)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The chosen snapshot as DCP metadata: every rank's store is searched (a rank on a new host finds
        the snapshot on the others'), and rank 0 chooses for all (DCP calls this on every rank, so the two
        collectives over `process_group` are safe; a `no_dist` load inside a distributed job is not).
        Failing to find one is reported from `set_up_storage_reader`, which DCP lets raise as it is (it
        would swallow the error here)."""
        if self.job is None:
            self._error = StateError("StoreReader needs a job: StoreReader(job), or a checkpoint_id")
            return Metadata(state_dict_metadata={})
        if world.active() and world.size(self.group) > 1:
            self._peers = set(world.all_gather(self.url, self.group))
        try:  # lost stores are handled in the global plan
            snap = world.decide(lambda: choose(self.job, self.step, self._urls(), check=False), self.group)
        except StateError as e:
            self._error = e
            return Metadata(state_dict_metadata={})
        meta = to_metadata(snap.manifest, snap.ptc)
        meta.storage_meta.load_id = self.load_id
        self._snap = snap
        return meta

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._error is not None:
            raise self._error
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's store and device (as `tenplex.load` names them) travel to the coordinator."""
        assert self._snap is not None
        device = describe(self.url, {}, {}, self.group).device
        info = {"store": self.url, "device": device, "snapshot": (self._snap.step, self._save_id)}
        return dataclasses.replace(plan, storage_data=info)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: the planner's plan from the snapshot to the ranks' read items; each rank's part."""
        snap = self._recheck(plans)
        new, owner = targets(plans, self.storage, snap.ptc)
        p = plan(subset(with_bytes(snap.view, self.storage), set(new.tensors)), new, lost=snap.lost)
        if not p.complete:
            raise UnrecoverableError([(t, str(b)) for t, b in p.unrecoverable])
        fetches: dict[int, list[Fetch]] = defaultdict(list)
        for f in p.fetches():
            fetches[owner[f.dst]].append(f)
        stores = [pl.storage_data["store"] for pl in plans]
        shared = {url: shared_remote_boxes(p, url) for url in set(stores)}
        return [
            dataclasses.replace(pl, storage_data=_Part(fetches[r], shared[url], snap.remap, stores, r))
            for r, (pl, url) in enumerate(zip(plans, stores))
        ]

    def _recheck(self, plans: list[LoadPlan]) -> Snapshot:
        """The snapshot every rank chose, with its lost stores and their replicas, still the one saved."""
        if len({p.storage_data["snapshot"] for p in plans}) > 1:
            raise StateError(
                f"the ranks chose different snapshots of {self.job!r} (a save committed during the load): "
                "load again, or name the step"
            )
        assert self._snap is not None
        step = self._snap.step
        snap = choose(self.job, step, self._urls(), check=True)
        if snap.manifest.get("save_id") != self._save_id:
            raise StateError(f"version {step} of {self.job!r} was saved again during the load: load again")
        return snap

    @property
    def _save_id(self) -> str | None:
        return None if self._snap is None else self._snap.manifest.get("save_id")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """This rank's part run by the executor; the targets written once every rank's reads arrived."""
        part: _Part = plan.storage_data
        assert self._snap is not None
        at = Version(self.job, self._snap.step, self._save_id)
        items = _Items(self.storage, self._snap.ptc)
        self.reads = []
        error = attempt(lambda: self.reads.extend(self._routes(part, items, plan.items, planner)))
        with HeldBoxes(items.shards, at, 8, Breakdown()) as held:  # lets go of held boxes on every way out
            if error is None:
                error = attempt(lambda: held.read(self.reads))
            if len(part.stores) > 1:  # every rank learns every rank's outcome (no collective for no_dist)
                failed = agree(error, self.group)
                error = None if failed is None else failed.raised("load the snapshot")
            drop_relays(at.job, at.step, self.url, part.stores, part.rank)
            if error is not None:
                raise error
            held.write()
        self.relayed = sum(r.via is Via.RELAY for r in self.reads)
        items.deliver(planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _routes(self, part: _Part, items: _Items, read: list[ReadItem], planner: LoadPlanner) -> list[Read]:
        """The executor's reads of this rank's part, each into the target of its read item."""
        items.resolve(read, planner)
        differ = {key(f.tensor, f.box) for f in part.fetches} ^ items.wanted()
        if differ:
            raise StateError(f"the plan and DCP's read items differ on {sorted(differ)[:3]}")
        snap = self._snap
        assert snap is not None
        if part.remap:  # the lost stores' ranks are served by their replicas
            snap = Snapshot(snap.step, snap.manifest, remap=part.remap)
        old = with_bytes(snap.view, self.storage)
        return routes(part.fetches, old, self.url, central=False, shared=part.shared,
                      target_of=lambda f: key(f.tensor, f.box))  # fmt: skip

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never chosen by DCP on its own: pass the reader explicitly


class _Items:
    """This rank's read items as the executor's targets, one shard each (`layout.key`), and their hand-over
    to DCP's planner once written. A range lands in its target itself, or, when the snapshot holds another
    dtype, in a tensor of that dtype, converted by `copy_` as DCP's own readers do."""

    def __init__(self, storage: dict[Any, Stored], snapshot: PTC) -> None:
        self.storage, self.snapshot = storage, snapshot
        self.shards: dict[str, LocalShard] = {}
        self._landed: list[tuple[ReadItem, LocalShard, torch.Tensor | None]] = []  # None: DCP's bytes
        self._values: list[tuple[ReadItem, Stored]] = []  # values the manifest holds

    def resolve(self, items: list[ReadItem], planner: LoadPlanner) -> None:
        for item in items:
            s = self.storage[item.storage_index]
            if not s.blob:
                self._values.append((item, s))
                continue
            box, meta = global_box(item, s), self.snapshot.tensors.get(s.name)
            target: torch.Tensor | None = None
            if meta is None:  # DCP's bytes: a blob of uint8
                shape, dtype, local = box.shape, "uint8", torch.empty(box.shape, dtype=torch.uint8)
            else:
                target = planner.resolve_tensor(item).detach()
                shape, dtype, local = meta.shape, meta.dtype, target
                if DTYPES.get(target.dtype) != meta.dtype:
                    local = torch.empty(target.shape, dtype=TORCH_DTYPES[meta.dtype])
            name = key(s.name, box)
            if name in self.shards:
                raise StateError(f"two read items of this rank fill {s.name!r} {box}")
            self.shards[name] = LocalShard(s.name, shape, dtype, box, local)
            self._landed.append((item, self.shards[name], target))

    def wanted(self) -> set[str]:
        return {k for k, shard in self.shards.items() if not shard.box.empty}

    def deliver(self, planner: LoadPlanner) -> None:
        for item, s in self._values:
            planner.load_bytes(item, s.value_bytes())
        for item, shard, target in self._landed:
            if target is None:
                planner.load_bytes(item, io.BytesIO(shard.local.numpy().tobytes()))
                continue
            if shard.local is not target:
                target.copy_(shard.local)
            planner.commit_tensor(item, target)
