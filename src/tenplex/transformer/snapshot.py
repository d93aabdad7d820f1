"""Snapshots in the stores: the manifest a save commits, which committed save a load takes, and `LoadInfo`.

A snapshot is one save's manifest (its PTC, its stores, its `save_id`) committed on every store it wrote
to. Choosing one is done by one rank for all (`world.decide`), so ranks never split between two versions or
between memory and the durable fallback; a store that does not answer is asked once per choice.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..ptc import PTC, Mesh
from ..ptc import values as value_codec
from ..store import StoreError, StoreUnavailable
from .errors import NoSnapshotError, StateError
from .gathered import blob_name
from .stores import client

MANIFEST_FORMAT = "tenplex.snapshot"


def make_manifest(
    job: str,
    step: int,
    ptc: PTC,
    *,
    layout: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
    save_id: str | None = None,
) -> dict[str, Any]:
    """The manifest of a new save of `ptc` (the writers' layout); `replicas` is added at commit time. With a
    cached layout, `layout` is its PTC's JSON without values and `values` this save's values.
    `save_id`: the one its writers opened the version under (default: a new one)."""
    data = ptc.to_json() if layout is None else {**layout, "values": value_codec.encode(values or {})}
    return {
        "format": MANIFEST_FORMAT,
        "job": job,
        "step": step,
        "save_id": save_id
        or uuid.uuid4().hex,  # tells this save's commits from an abandoned attempt at the same step
        "ptc": data,
        "stores": sorted(set(ptc.mesh.hosts)),
    }


@dataclass
class Snapshot:
    """One complete save chosen for a load: its step and manifest, the stores of it that do not answer
    (`lost`), and the dead stores whose blobs a replica store holds (`remap`: dead -> replica)."""

    step: int
    manifest: dict[str, Any]
    lost: list[str] = field(default_factory=list)
    remap: dict[str, str] = field(default_factory=dict)

    @cached_property
    def ptc(self) -> PTC:
        """Parsed once (for a job of a few hundred tensors that takes ~0.1 s)."""
        return PTC.from_json(self.manifest["ptc"])

    @cached_property
    def view(self) -> PTC:
        """The snapshot's PTC with every remapped store's ranks served by its replica store (`remap` is
        final when this is first read)."""
        old = self.ptc
        if not self.remap:
            return old
        hosts = tuple(self.remap.get(h, h) for h in old.mesh.hosts)
        return PTC(Mesh(old.mesh.axes, old.mesh.devices, hosts), old.tensors, old.placements, old.values)


@dataclass
class LoadInfo:
    """What one rank's load did; `bytes` by route (kept / same_host / relayed / cross_host)."""

    job: str
    step: int
    seconds: float
    bytes: dict[str, int] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    lost_stores: list[str] = field(default_factory=list)
    source: str = "memory"  # or "durable"
    note: str = ""  # why a durable load happened
    plan_bytes: dict[str, int] = field(default_factory=dict)  # the whole job's plan statistics
    phases: dict[str, float] = field(default_factory=dict)  # seconds by phase (see `breakdown`)
    skipped: list[dict[str, Any]] = field(default_factory=list)  # newer snapshots that could not be read


def choose(
    job: str, step: int | None, urls: list[str], *, check: bool = True, below: int | None = None
) -> Snapshot:
    """The newest snapshot of `job` (or version `step`; with `below`, the newest before that step) that is
    complete on the reachable stores among `urls`. With `check`, also its lost and remapped stores, and
    every blob it will be read from checked against its piece. Raises NoSnapshotError when there is none
    and StateError when the stores misbehave (a job must not silently start over then)."""
    try:
        found, manifest, answered = _newest(job, step, urls, below)
        snap = Snapshot(found, manifest)
        if check:
            sid = manifest.get("save_id")
            lost, snap.remap = _lost_stores(snap.ptc, job, found, manifest.get("replicas", {}), sid, answered)
            snap.lost = sorted(lost)
            check_blobs(snap.view, job, found, lost, sid)
        return snap
    except StoreError as e:
        raise StateError(f"job {job!r}: cannot read the snapshots in the stores ({e})") from None


def newest_step(job: str, stores: list[str]) -> int | None:
    """The step `load` would resume `job` from with these stores, or None when there is no snapshot (or
    the stores cannot tell)."""
    try:
        return choose(job, None, stores, check=False).step
    except StateError:
        return None


def _newest(
    job: str, step: int | None, urls: list[str], below: int | None = None
) -> tuple[int, dict, set[str]]:
    """The newest version committed, by one save, on every reachable store it was saved to, its manifest,
    and the stores that answered. A writer that died between its per-store commits leaves a version some
    stores hide (the one before it is used); a later save of the same step replaces it where it writes,
    and its save id tells the two apart."""
    where: dict[int, dict[str | None, str]] = defaultdict(dict)  # step -> save id -> a store holding it
    ids: dict[str, dict[int, str | None] | None] = {}  # None: the store does not answer (asked once)
    errors = []
    for u in urls:
        try:
            ids[u] = client(u).save_ids(job)
        except StoreUnavailable as e:
            ids[u] = None
            errors.append(str(e))
            continue
        for s, sid in ids[u].items():
            if (step is None or s == step) and (below is None or s < below):
                where[s].setdefault(sid, u)
    for s in sorted(where, reverse=True):
        for sid, u in where[s].items():
            manifest = client(u).manifest(job, s)
            if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
                raise NoSnapshotError(f"version {s} of job {job!r} is not a tenplex snapshot")
            if all(_holds(u2, job, s, sid, ids) for u2 in manifest.get("stores", [])):
                return s, manifest, {u for u, known in ids.items() if known is not None}
    what = f"step {step} of " if step is not None else (f"a step before {below} of " if below else "")
    raise NoSnapshotError(
        f"no committed version of {what}job {job!r} in stores {urls}"
        + (f" ({'; '.join(errors)})" if errors else "")
    )


def _holds(url: str, job: str, step: int, save_id: str | None, known: dict) -> bool:
    """True when the store has that save of the version committed, or does not answer (a lost host,
    handled later). `known` caches each store's answer, a dead store's too."""
    if url not in known:
        try:
            known[url] = client(url).save_ids(job)
        except StoreUnavailable:
            known[url] = None
    have = known[url]
    return have is None or have.get(step, ...) == save_id


def _lost_stores(
    old: PTC,
    job: str,
    step: int,
    replicas: dict[str, list[str]],
    save_id: str | None = None,
    answered: AbstractSet[str] = frozenset(),
) -> tuple[set[str], dict[str, str]]:
    """Old stores that do not answer (those in `answered` did a moment ago: not asked again); those whose
    blobs of this save (`save_id`) a replica store holds are remapped to it (a copy of another save of the
    step, with the same blob names, never is)."""
    down = set()
    for url in sorted(set(old.mesh.hosts) - answered):
        try:
            client(url).health()
        except StoreError:
            down.add(url)
    remap: dict[str, str] = {}
    if down:
        candidates = {u for d in down for u in replicas.get(d, [])} | (set(old.mesh.hosts) - down)
        for url in sorted(candidates - down):
            try:
                listing = client(url).blobs(job, step, save_id)
            except StoreError:
                continue
            held = {b["name"] for b in listing}
            for dead in sorted(down - set(remap)):
                ranks = [r for r, h in enumerate(old.mesh.hosts) if h == dead]
                needed = {blob_name(r, s.tensor) for r in ranks for s in old.shards(r)}
                if needed <= held:
                    remap[dead] = url
    return down - set(remap), remap


def check_blobs(view: PTC, job: str, step: int, lost: set[str], save_id: str | None = None) -> None:
    """Every blob a load may read is in its store with its piece's shape and its tensor's dtype, so that a
    blob of another layout or dtype is never read as this snapshot's (one listing per store)."""
    expected: dict[str, dict[str, tuple[list[int], str]]] = defaultdict(dict)  # store -> blob -> meta
    for r, host in enumerate(view.mesh.hosts):
        if host not in lost:
            for s in view.shards(r):
                expected[host][blob_name(r, s.tensor)] = (list(s.box.shape), view.tensors[s.tensor].dtype)
    for url, blobs in sorted(expected.items()):
        listing = {b["name"]: b for b in client(url).blobs(job, step, save_id)}
        for name, (shape, dtype) in sorted(blobs.items()):
            b = listing.get(name)
            if b is None:
                raise StateError(f"store {url} lacks blob {name!r} of {job!r} at step {step}")
            if (list(b.get("shape", [])), b.get("dtype")) != (shape, dtype):
                raise StateError(
                    f"blob {name!r} of {job!r} at step {step} in {url} is {b.get('dtype')}{b.get('shape')}, "
                    f"but the snapshot's piece is {dtype}{shape}"
                )
