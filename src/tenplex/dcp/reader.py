"""`StoreReader`: DCP's `StorageReader` on the tensor stores.

DCP plans which byte ranges every rank needs; the coordinator picks, per range, a store that holds it (the
reading rank's own store first, surviving replicas for lost stores) and marks ranges that several ranks of
one host need from another host, which that host's store then fetches once (relay) and serves to each.
Every range lands in the target tensor (shared memory on the same host, the network otherwise), checked
against the chunk digests on the way.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..ptc import PTC, Box
from ..store import StoreError, read_many, relay_many
from ..store.keys import check_job, check_step
from ..transformer import world
from ..transformer.durable import TORCH_DTYPES
from ..transformer.errors import StateError, UnrecoverableError
from ..transformer.shards import DTYPES, Staged
from ..transformer.snapshot import choose
from ..transformer.stores import client, resolve
from ..util import env
from .location import location
from .metadata import Stored, to_metadata

Source = tuple[str, str, bool] | None  # (store URL, blob name, through the own store's relay); None: a value


class StoreReader(StorageReader):
    """Read version `step` (default: the newest complete one) of `job` from the tensor stores.

    A `checkpoint_id` (given here or to `dcp.load`) names the version instead: a step number of `job`, or a
    path mapped to a job and step by `tenplex.dcp.location`, as `StoreWriter` maps it.

    `store`: this rank's store (default $TENPLEX_STORE, else the local default). `sources`: more stores to
    look in (default $TENPLEX_SOURCES, comma-separated), e.g. the old hosts' stores after a move.
    `process_group`: the group given to `dcp.load`, when not the default one (ranks that share relayed
    ranges wait for each other before the relay cache is freed).
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
        self._chosen: tuple[int, dict, PTC] | None = None
        self._error: BaseException | None = None
        self._peers: set[str] = set()  # the stores of the other ranks of the load
        self.relayed = 0  # ranges the last load took through this host's relay (fetched once per host)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.job, self.step = location(checkpoint_id, self.job)
        self.load_id = uuid.uuid4().hex
        self._chosen, self._error = None, None

    @property
    def chosen_step(self) -> int | None:
        """The step the last `dcp.load` read (after `read_metadata`)."""
        return None if self._chosen is None else self._chosen[0]

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
        meta, ptc = to_metadata(snap.manifest)
        meta.storage_meta.load_id = self.load_id
        self._chosen = (snap.step, snap.manifest, ptc)
        return meta

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if self._error is not None:
            raise self._error
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        step, manifest, _ = self._chosen
        snapshot = (step, manifest["save_id"])
        return dataclasses.replace(plan, storage_data={"store": self.url, "snapshot": snapshot})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: one source per range for every rank, and the ranges each host relays."""
        if len({p.storage_data["snapshot"] for p in plans}) > 1:
            raise StateError(
                f"the ranks chose different snapshots of {self.job!r} (a save committed during the load): "
                "load again, or name the step"
            )
        step, manifest, _ = self._chosen
        snap = choose(self.job, step, self._urls(), check=True)
        if snap.manifest.get("save_id") != manifest.get("save_id"):
            raise StateError(f"version {step} of {self.job!r} was saved again during the load: load again")
        lost, hosts = set(snap.lost), list(snap.view.mesh.hosts)
        picks: list[list[tuple[str, str, Box] | None]] = []
        readers: dict[tuple[str, str, str, Box], set[int]] = defaultdict(set)
        missing: list[tuple[str, str]] = []
        for r, p in enumerate(plans):
            own, mine = p.storage_data["store"], []
            for item in p.items:
                s = self.storage[item.storage_index]
                if not s.blob:
                    mine.append(None)
                    continue
                alive = [h for h in s.holders if hosts[h] not in lost]
                if not alive:
                    missing.append((s.name, str(s.box)))
                    mine.append(None)
                    continue
                h = next((h for h in alive if hosts[h] == own), alive[r % len(alive)])
                box = _range(item, s)
                mine.append((hosts[h], s.blob_of(h), box))
                readers[(own, hosts[h], s.blob_of(h), box)].add(r)
            picks.append(mine)
        if missing:
            raise UnrecoverableError(missing)
        shared = {k for k, ranks in readers.items() if len(ranks) > 1 and k[0] != k[1]}
        # the lowest rank relaying through each store frees that store's relay cache once all have read
        relaying = {k[0] for k in shared}
        droppers = {min(r for k in shared if k[0] == own for r in readers[k]) for own in relaying}
        out = []
        for r, (p, mine) in enumerate(zip(plans, picks)):
            own = p.storage_data["store"]
            sources: list[Source] = [None if m is None else (m[0], m[1], (own, *m) in shared) for m in mine]
            data = {"sources": sources, "relays": bool(shared), "drop": r in droppers, "step": step}
            out.append(dataclasses.replace(p, storage_data=data))
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        data = plan.storage_data
        step, own = data["step"], client(self.url)
        try:
            values, tensors, direct, relayed = self._reads(plan, planner)
            self.relayed = len(relayed)
            try:
                sid = self._chosen[1].get("save_id")  # every read of the chosen save only
                with ThreadPoolExecutor(max_workers=1) as pool:
                    relays = pool.submit(relay_many, [(own, *r) for r in relayed], self.job, step, 8, sid)
                    read_many(direct, 8, sid)
                    relays.result()
            except StoreError as e:
                raise StateError(f"loading the snapshot of {self.job!r} at step {step}: {e}") from e
        finally:
            if data["relays"]:  # every rank reaches this, so that none waits for a rank that failed
                world.barrier(self.group)
                if data["drop"]:
                    try:
                        own.drop_relay(self.job, step)
                    except StoreError:
                        pass
        _deliver(values, tensors, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _reads(self, plan: LoadPlan, planner: LoadPlanner) -> tuple[list, list, list, list]:
        """Where each item of `plan` lands (values: bytes for DCP; tensors: staged targets) and the reads
        that fill them, direct and relayed; values this rank's own manifest holds are handed over now."""
        data = plan.storage_data
        values, tensors, direct, relayed = [], [], [], []
        for item, src in zip(plan.items, data["sources"]):
            s = self.storage[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                if src is None:
                    planner.load_bytes(item, s.value_bytes())
                    continue
                out = np.empty(s.box.shape, np.uint8)
                values.append((item, out))
            else:
                target = planner.resolve_tensor(item).detach()
                staged = _staging(target, self._chosen[2].tensors[s.name].dtype)
                out = staged.array if staged.array.flags.c_contiguous else np.empty_like(staged.array)
                tensors.append((item, target, staged, out))
            url, blob, relay = src
            box = _range(item, s)
            if relay:
                relayed.append((url, blob, box, out))
            else:
                direct.append((client(url), self.job, data["step"], blob, box, out))
        return values, tensors, direct, relayed

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never chosen by DCP on its own: pass the reader explicitly


def _staging(target: torch.Tensor, stored: str) -> Staged:
    """Where a range lands: in the target itself, or, when the snapshot holds another dtype, in a tensor of
    that dtype (converted into the target once read)."""
    if DTYPES.get(target.dtype) == stored:
        return Staged(target, fill=False)
    return Staged(torch.empty(target.shape, dtype=TORCH_DTYPES[stored]), fill=False)


def _deliver(values: list, tensors: list, planner: LoadPlanner) -> None:
    """The bytes read, handed to DCP's planner: values as streams, tensors written into their targets
    (converted by `copy_` where the snapshot's dtype differs, as DCP's own readers do)."""
    for item, out in values:
        planner.load_bytes(item, io.BytesIO(out.tobytes()))
    for item, target, staged, out in tensors:
        if out is not staged.array:
            np.copyto(staged.array, out)
        if staged.tensor is target:
            staged.finish()
        else:
            target.copy_(staged.tensor)
        planner.commit_tensor(item, target)


def _range(item: Any, s: Stored) -> Box:
    """The box of the stored blob a read item names (bytes: the whole blob)."""
    if item.type == LoadItemType.BYTE_IO:
        return s.box
    start = tuple(int(o) for o in item.storage_offsets)
    return Box(start, tuple(a + int(n) for a, n in zip(start, item.lengths)))
