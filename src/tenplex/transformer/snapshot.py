"""Snapshots in the stores: the manifest a save commits, which committed save a load takes, and `LoadInfo`.

A snapshot is one save's manifest (its PTC, its stores, its `save_id`) committed on every store it wrote
to. Choosing one is done by one rank for all (`world.decide`), so ranks never split between two versions or
between memory and the durable fallback; a store that does not answer is asked once per choice.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..ptc import PTC, Mesh
from ..ptc import values as value_codec
from ..store import AuthError, StoreError, StoreUnavailable
from ..util import env
from ..util.parallel import each
from . import jobrecord
from .errors import NoSnapshotError, StateError, StoresLostError
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


@dataclass(frozen=True)
class Version:
    """The one save a load reads: every read names its `save_id`, so a store holding another save of the
    step answers NotFound instead of that save's bytes."""

    job: str
    step: int
    save_id: str | None = None


@dataclass
class Snapshot:
    """One complete save chosen for a load: its step and manifest, the stores of it that cannot serve it
    (`lost`, each with why in `why`: unreachable, unproven, restarted), and the dead stores whose blobs a
    replica store holds (`remap`: dead -> replica)."""

    step: int
    manifest: dict[str, Any]
    lost: list[str] = field(default_factory=list)
    remap: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    @cached_property
    def ptc(self) -> PTC:
        """Parsed once (a job of a few hundred tensors takes a noticeable time to parse)."""
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
    lost_why: dict[str, str] = field(default_factory=dict)  # lost store -> unreachable / unproven / restarted
    # lost stores whose blobs of this save a replica store served (lost store -> replica): in `lost_stores`
    # too, so the record of a recovery names every store it lost, served or not
    replaced: dict[str, str] = field(default_factory=dict)


def stamp(manifest: dict[str, Any]) -> None:
    """Before a commit: where each store of the save copies its versions (`replicas`, so a load finds them
    when the store dies) and each store's incarnation (so a load can tell a store that restarted since,
    and lost the save, from one that deleted it)."""
    health = {u: client(u).health() for u in manifest["stores"]}
    manifest["replicas"] = {u: h.get("replicas", []) for u, h in health.items()}
    manifest["incarnations"] = {u: h.get("incarnation") for u, h in health.items()}


def choose(
    job: str, step: int | None, urls: list[str], *, check: bool = True, below: int | None = None
) -> Snapshot:
    """The newest snapshot of `job` (or version `step`; with `below`, the newest before that step) that is
    complete on the stores among `urls` that can answer for it. With `check`, also its lost and remapped
    stores, and every blob it will be read from checked against its piece.

    Raises NoSnapshotError only when every store asked (and every store the job's record names) answered,
    in the incarnation that held the job's saves, that it has none — the one answer that may start a job
    over. StoresLostError when none is complete on the stores that answer but stores that may hold one
    are lost; StateError when the stores misbehave."""
    answers = Answers(job)
    rec = answers.record  # the stores of the job's newest save are searched wherever it moved since
    urls = list(urls) + sorted(set(rec.stores) - set(urls)) if rec is not None else urls
    try:
        answers.ask(urls)
        found, manifest = _newest(job, step, urls, below, answers)
        snap = Snapshot(found, manifest)
        if check:
            sid = manifest.get("save_id")
            snap.why, snap.remap = _lost_stores(snap.ptc, job, found, manifest, answers)
            snap.lost = sorted(set(snap.why) - set(snap.remap))
            check_blobs(snap.view, job, found, set(snap.lost), sid)
        return snap
    except StoreError as e:
        raise StateError(f"job {job!r}: cannot read the snapshots in the stores ({e})") from None


def newest_step(job: str, stores: list[str]) -> int | None:
    """The step `load` would resume `job` from with these stores; None when there is none to resume from
    (StoresLostError goes through: stores that may hold one are lost)."""
    try:
        return choose(job, None, stores, check=False).step
    except StoresLostError:
        raise
    except StateError:
        return None


@dataclass
class Answer:
    """What one store said about a job: its committed saves by step and its incarnation, or, when it could
    not say (`ids` None), why: a store that cannot answer is a lost store, never an empty one."""

    ids: dict[int, list[str | None]] | None  # step -> the committed saves of it a read can name here
    incarnation: str | None = None
    why: str = ""

    def has(self, step: int, save_id: str | None) -> bool:
        return self.ids is not None and save_id in self.ids.get(step, ())


class Answers(dict[str, Answer]):
    """Each store's answer for one choice, asked once (a dead store too)."""

    def __init__(self, job: str) -> None:
        super().__init__()
        self.job = job
        self.record = jobrecord.read(job)  # read once per choice, like each store's answer

    def __missing__(self, url: str) -> Answer:
        self[url] = self._ask(url)
        return self[url]

    def ask(self, urls: list[str]) -> None:
        """Every store in `urls` not asked yet, all at once (one round trip's wait, not one per store)."""
        todo = [u for u in dict.fromkeys(urls) if u not in self]
        for u, answer in zip(todo, each(self._ask, todo)):
            self[u] = answer

    def _ask(self, url: str) -> Answer:
        if url in env.url_list(env.LOST):  # its host is gone: asking would only wait for silence
            return Answer(None, why="unreachable: its host was lost or left (the runtime said so)")
        c = client(url)
        try:  # the listing first, then the incarnation: a restart in between shows as a new incarnation
            ids = c.committed_saves(self.job)
            return Answer(ids, c.health().get("incarnation"))
        except AuthError as e:
            return Answer(None, why=f"unproven: {e}")
        except StoreUnavailable as e:
            return Answer(None, why=f"unreachable: {e}")

    def lost(self, url: str, incarnation: str | None, since: str = "the save") -> str | None:
        """Why `url` cannot answer for what its `incarnation` held (None: it can): it does not answer, or
        it restarted since (`since` names the save)."""
        a = self[url]
        if a.ids is None:
            return a.why
        if incarnation is not None and a.incarnation != incarnation:
            return f"restarted: a new incarnation since {since}"
        return None

    def holds(self, url: str, step: int, save_id: str | None, manifest: dict[str, Any]) -> bool:
        """Whether the store has that save committed, or cannot answer for it (a lost store: handled by
        the plan, which reads its pieces elsewhere or says they are gone)."""
        if self[url].has(step, save_id):
            return True
        return self.lost(url, manifest.get("incarnations", {}).get(url)) is not None


def _newest(
    job: str, step: int | None, urls: list[str], below: int | None, answers: Answers
) -> tuple[int, dict]:
    """The newest version committed, by one save, on every store it was saved to that can answer for it,
    and its manifest. A writer that died between its per-store commits leaves a version some stores hide
    (the one before it is used); a later save of the same step replaces it where it writes, and its save
    id tells the two apart."""
    where: dict[int, dict[str | None, str]] = defaultdict(dict)  # step -> save id -> a store holding it
    for u in urls:
        for s, sids in (answers[u].ids or {}).items():
            if (step is None or s == step) and (below is None or s < below):
                for sid in sids:
                    where[s].setdefault(sid, u)
    seen: list[dict[str, Any]] = []  # manifests of saves that are not complete: they name stores too
    for s in sorted(where, reverse=True):
        for sid, u in where[s].items():
            manifest = client(u).manifest(job, s, sid)
            if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
                raise NoSnapshotError(f"version {s} of job {job!r} is not a tenplex snapshot")
            if manifest.get("save_id") not in (None, sid):  # saved again meanwhile: the next choice sees it
                continue
            if all(answers.holds(u2, s, sid, manifest) for u2 in manifest.get("stores", [])):
                return s, manifest
            seen.append(manifest)
    what = f"step {step} of " if step is not None else (f"a step before {below} of " if below else "")
    lost = _lost_anywhere(urls, seen, answers)
    if lost:
        raise StoresLostError(job, lost)
    raise NoSnapshotError(f"no committed version of {what}job {job!r} in stores {urls}")


def _lost_anywhere(urls: list[str], seen: list[dict[str, Any]], answers: Answers) -> dict[str, str]:
    """The stores that may hold a snapshot of the job but cannot answer for it: those asked that do not
    answer, and those that the manifests found and the job's record name in an incarnation gone since."""
    lost = {u: answers[u].why for u in urls if answers[u].ids is None}
    for m in seen:
        for u in m.get("stores", []):
            why = answers.lost(u, m.get("incarnations", {}).get(u), f"the save of step {m.get('step')}")
            if why:
                lost.setdefault(u, why)
    rec = answers.record
    if rec is not None:
        for u, inc in sorted(rec.stores.items()):
            why = answers.lost(u, inc, f"the save of step {rec.step} ({rec.path})")
            if why:
                lost.setdefault(u, why)
    return lost


def _lost_stores(
    old: PTC, job: str, step: int, manifest: dict[str, Any], answers: Answers
) -> tuple[dict[str, str], dict[str, str]]:
    """The old stores that cannot serve this save, with why (remapped ones too); those whose blobs of this
    save a replica store holds are remapped to it (a copy of another save of the step, with the same blob
    names, never is)."""
    save_id, incarnations = manifest.get("save_id"), manifest.get("incarnations", {})
    down: dict[str, str] = {}
    for url in sorted(set(old.mesh.hosts)):
        if answers[url].has(step, save_id):
            continue
        why = answers.lost(url, incarnations.get(url))
        if why:
            down[url] = why
    remap: dict[str, str] = {}
    if down:
        replicas = manifest.get("replicas", {})
        candidates = {u for d in down for u in replicas.get(d, [])} | (set(old.mesh.hosts) - set(down))
        for url in sorted(candidates - set(down)):
            try:
                listing = client(url).blobs(job, step, save_id)
            except StoreError:
                continue
            held = {b["name"] for b in listing}
            for dead in sorted(set(down) - set(remap)):
                ranks = [r for r, h in enumerate(old.mesh.hosts) if h == dead]
                needed = {blob_name(r, s.tensor) for r in ranks for s in old.shards(r)}
                if needed <= held:
                    remap[dead] = url
    return down, remap


def check_blobs(view: PTC, job: str, step: int, lost: set[str], save_id: str | None = None) -> None:
    """Every blob a load may read is in its store with its piece's shape and its tensor's dtype, so that a
    blob of another layout or dtype is never read as this snapshot's (one listing per store)."""
    expected: dict[str, dict[str, tuple[list[int], str]]] = defaultdict(dict)  # store -> blob -> meta
    for r, host in enumerate(view.mesh.hosts):
        if host not in lost:
            for s in view.shards(r):
                expected[host][blob_name(r, s.tensor)] = (list(s.box.shape), view.tensors[s.tensor].dtype)
    urls = sorted(expected)
    for url, listed in zip(urls, each(lambda u: client(u).blobs(job, step, save_id), urls)):
        listing = {b["name"]: b for b in listed}
        for name, (shape, dtype) in sorted(expected[url].items()):
            b = listing.get(name)
            if b is None:
                raise StateError(f"store {url} lacks blob {name!r} of {job!r} at step {step}")
            if (list(b.get("shape", [])), b.get("dtype")) != (shape, dtype):
                raise StateError(
                    f"blob {name!r} of {job!r} at step {step} in {url} is {b.get('dtype')}{b.get('shape')}, "
                    f"but the snapshot's piece is {dtype}{shape}"
                )
