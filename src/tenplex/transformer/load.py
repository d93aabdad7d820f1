"""`tenplex.load`: each rank computes its part of the plan from the manifest and pulls its boxes.

Boxes on this host come through shared memory; boxes of other hosts come through this host's store, which
fetches each remote box once and serves it to every local rank that needs it (the planner's lower bound).
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..planner import Fetch, Route, plan
from ..ptc import PTC
from ..store import StoreClient, StoreError, StoreUnavailable, read_many
from . import world
from .errors import KeyMismatchError, NoSnapshotError, ShapeMismatchError, StateError, UnrecoverableError
from .layout import blob_name, build_ptc, gather, merged_values, subset
from .save import MANIFEST_FORMAT
from .shards import LocalShard, Staged, local_shard
from .stores import client, resolve
from .tree import expand, flatten, restore


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
    back to when some boxes have no surviving in-memory copy. `process_group`: the ranks of the job.
    `sources`: more stores to look for the snapshot in (default $TENPLEX_SOURCES, comma-separated) — the
    old hosts' stores when the job moved to new hosts; the ranks' own stores are always searched.
    """
    started = time.perf_counter()
    url = resolve(store)
    tree = expand(state_dict)
    tensors, values = flatten(tree)
    shards = {n: local_shard(n, t) for n, t in tensors.items()}
    layouts = gather(url, shards, values, process_group)
    wanted = merged_values(layouts)  # the value names of the whole target job
    new = build_ptc(layouts)
    group = process_group
    if sources is None:
        sources = [s for s in os.environ.get("TENPLEX_SOURCES", "").split(",") if s]
    urls = sorted({lay.store for lay in layouts} | {resolve(s) for s in sources}, key=lambda u: u != url)
    # one rank decides which snapshot and which stores are lost, so that all ranks agree (a store that
    # answers one rank and not another would otherwise split them between memory and the DCP fallback)
    chosen = world.broadcast(_decide(job, step, urls) if world.rank(group) == 0 else None, group)
    if isinstance(chosen, str | StateError):  # no snapshot in memory, or the stores cannot say which
        if path is not None:
            from .durable import load_durable

            return load_durable(
                state_dict, path, strict=strict, started=started, reason=str(chosen), process_group=group
            )
        raise chosen if isinstance(chosen, StateError) else NoSnapshotError(chosen)
    step, manifest, (lost, remap) = chosen
    old = PTC.from_json(manifest["ptc"])
    common = _check_keys(old, new, wanted, strict)
    old_view = _remap_hosts(old, remap)
    p = plan(subset(old_view, common), subset(new, common), lost=sorted(lost))
    if not p.complete:
        if path is not None:
            from .durable import load_durable

            return load_durable(
                state_dict, path, strict=strict, started=started, reason="unrecoverable", process_group=group
            )
        raise UnrecoverableError([(t, str(b)) for t, b in p.unrecoverable])
    me = world.rank(group)
    shared = _shared_remote_boxes(p, new.mesh.hosts[me])
    moved = _execute(p.for_rank(me), shards, job, step, old_view, url, central, concurrency, shared)
    restore(state_dict, tree, {k: v for k, v in old.values.items() if k in values})
    world.barrier(group)
    _drop_relays(job, step, url, layouts, me)
    missing, unexpected = _differences(old, new, wanted)
    s = p.stats
    return LoadInfo(
        job,
        step,
        time.perf_counter() - started,
        moved,
        missing,
        unexpected,
        sorted(lost),
        plan_bytes={"kept": s.kept, "same_host": s.same_host, "relayed": s.relayed,
                    "cross_host": s.cross_host, "cross_host_lower_bound": s.cross_host_lower_bound},
    )  # fmt: skip


def newest_step(job: str, stores: list[str]) -> int | None:
    """The step `load` would resume `job` from with these stores, or None when there is no snapshot (or
    the stores cannot tell)."""
    found = choose_snapshot(job, None, stores)
    return found[0] if isinstance(found, tuple) else None


def _decide(job: str, step: int | None, urls: list[str]) -> tuple | str | StateError:
    """The snapshot (step, manifest) and its lost and remapped stores, or why there is none."""
    chosen = choose_snapshot(job, step, urls)
    if not isinstance(chosen, tuple):
        return chosen
    found, manifest = chosen
    old = PTC.from_json(manifest["ptc"])
    return found, manifest, _lost_stores(old, job, found, manifest.get("replicas", {}))


def choose_snapshot(job: str, step: int | None, urls: list[str]) -> tuple[int, dict] | str | StateError:
    """(step, manifest) from any reachable store among `urls`, or why there is none: a reason (no
    snapshot), or an error (the stores misbehave: a job must not silently start over then). Returned, not
    raised, because one rank chooses for all."""
    try:
        return _newest(job, step, urls)
    except StoreError as e:
        return StateError(f"job {job!r}: cannot read the snapshots in the stores ({e})")


def _newest(job: str, step: int | None, urls: list[str]) -> tuple[int, dict] | str:
    """The newest version committed, by one save, on every reachable store it was saved to. A writer that
    died between its per-store commits leaves a version some stores hide (the one before it is used); a
    later save of the same step replaces it where it writes, and its save id tells the two apart."""
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
            if step is None or s == step:
                where[s].setdefault(sid, u)
    for s in sorted(where, reverse=True):
        for sid, u in where[s].items():
            manifest = client(u).manifest(job, s)
            if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
                return f"version {s} of job {job!r} is not a tenplex snapshot"
            if all(_holds(u2, job, s, sid, ids) for u2 in manifest.get("stores", [])):
                return s, manifest
    what = f"step {step} of " if step is not None else ""
    return f"no committed version of {what}job {job!r} in stores {urls}" + (
        f" ({'; '.join(errors)})" if errors else ""
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


def _lost_stores(
    old: PTC, job: str, step: int, replicas: dict[str, list[str]]
) -> tuple[set[str], dict[str, str]]:
    """Old stores that do not answer; those whose blobs a replica store holds are remapped to it."""
    down = set()
    for url in sorted(set(old.mesh.hosts)):
        try:
            client(url).health()
        except StoreError:
            down.add(url)
    remap: dict[str, str] = {}
    if down:
        candidates = {u for d in down for u in replicas.get(d, [])} | (set(old.mesh.hosts) - down)
        for url in sorted(candidates - down):
            try:
                listing = client(url).blobs(job, step)
            except StoreError:
                continue
            held = {b["name"] for b in listing}
            for dead in sorted(down - set(remap)):
                ranks = [r for r, h in enumerate(old.mesh.hosts) if h == dead]
                needed = {blob_name(r, s.tensor) for r in ranks for s in old.shards(r)}
                if needed <= held:
                    remap[dead] = url
    return down - set(remap), remap


def _remap_hosts(old: PTC, remap: dict[str, str]) -> PTC:
    if not remap:
        return old
    from ..ptc import Mesh

    hosts = tuple(remap.get(h, h) for h in old.mesh.hosts)
    return PTC(Mesh(old.mesh.axes, old.mesh.devices, hosts), old.tensors, old.placements, old.values)


def _shared_remote_boxes(p: Any, host: str) -> set[tuple[str, Any, int]]:
    """(tensor, box, source rank) that more than one rank of `host` pulls from another host: only those go
    through the host's store (fetched once, served to each); a box one rank alone needs is read directly."""
    out = set()
    for g in p.groups:
        for m in g.moves:
            if m.route is Route.RELAYED and p.new.mesh.hosts[m.dst] == host:
                out.update((t, m.box, m.src) for t in g.tensors)
    return out


def _execute(
    fetches: list[Fetch],
    shards: dict[str, LocalShard],
    job: str,
    step: int,
    old: PTC,
    url: str,
    central: bool,
    concurrency: int,
    shared: set[tuple[str, Any, int]],
) -> dict[str, int]:
    """Pull every box of this rank into its tensors.

    Boxes read from one store are batched (one lookup on this host, one request over the network per
    batch) and the stores are read in parallel; boxes several local ranks need from another host go
    through this host's store, which fetches each once."""
    staged = {name: Staged(shards[name].local, fill=False) for name in {f.tensor for f in fetches}}
    own = client(url)
    hub: StoreClient | None = client(old.mesh.hosts[0]) if central else None
    sources = {(name, r): piece.box for name in staged for piece in old.pieces(name) for r in piece.holders}
    moved: dict[str, int] = {"central": 0} if central else {r.value: 0 for r in Route}
    direct: list[tuple[StoreClient, str, int, str, Any, np.ndarray]] = []
    relayed: list[tuple[StoreClient, str, str, Any, np.ndarray]] = []
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    for f in fetches:
        dst = staged[f.tensor].array[(*f.box.relative_to(shards[f.tensor].box).slices(), ...)]
        out = dst if dst.flags.c_contiguous else np.empty(dst.shape, dst.dtype)
        if out is not dst:
            copies.append((dst, out))
        src_box = f.box.relative_to(sources[(f.tensor, f.src)])
        src_url, blob = old.mesh.hosts[f.src], blob_name(f.src, f.tensor)
        if hub is not None:
            if src_url == hub.url:
                direct.append((hub, job, step, blob, src_box, out))
            else:
                relayed.append((hub, src_url, blob, src_box, out))
        elif src_url == url:
            direct.append((own, job, step, blob, src_box, out))
        elif (f.tensor, f.box, f.src) in shared:
            relayed.append((own, src_url, blob, src_box, out))
        else:
            direct.append((client(src_url), job, step, blob, src_box, out))
        moved["central" if central else f.route.value] += f.box.volume * old.tensors[f.tensor].itemsize
    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            relays = [pool.submit(c.fetch_remote, u, job, step, b, box, o) for c, u, b, box, o in relayed]
            read_many(direct, concurrency)
            for fut in relays:
                fut.result()
    except StoreError as e:
        raise StateError(f"loading the snapshot of {job!r} at step {step}: {e}") from e
    for dst, out in copies:
        np.copyto(dst, out)
    for s in staged.values():
        s.finish()
    return moved


def _drop_relays(job: str, step: int, url: str, layouts: list, me: int) -> None:
    """The lowest rank of each store frees that store's relay cache once everyone has loaded."""
    first = {}
    for lay in layouts:
        first.setdefault(lay.store, lay.rank)
    if first.get(url) == me:
        try:
            client(url).drop_relay(job, step)
        except StoreError:
            pass
