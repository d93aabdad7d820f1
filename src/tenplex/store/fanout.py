"""Reads across many stores at once: boxes batched per (store, version) or per (store, peer), at most
`concurrency` requests in flight, every byte landing in its final array."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ..ptc import Box
from ..util.parallel import each
from .relay_client import RELAY_BATCH
from .same_host import Held

if TYPE_CHECKING:
    from .client import BoxRequest, StoreClient

__all__ = ["hold_relayed_many", "read_many", "relay_many"]


def read_many(
    requests: Iterable[tuple[StoreClient, str, int, str, Box, np.ndarray]],
    concurrency: int = 8,
    save_id: str | None = None,
    sums: dict[int, list[int]] | None = None,
) -> None:
    """Read boxes from many stores in parallel into the callers' arrays (`sums`: see `read_body.into`).

    Requests to the same (store, job, version) are batched (up to 256 boxes / 256 MiB per request); at most
    `concurrency` requests are in flight, and since every byte lands in its final array the memory used is
    bounded by the connections' buffers, whatever the total size."""
    batches: dict[tuple[int, str, int], list[list[BoxRequest]]] = {}
    clients: dict[int, StoreClient] = {}
    sizes: dict[tuple[int, str, int], int] = {}
    for client, job, step, name, box, out in requests:
        key = (id(client), job, step)
        clients[id(client)] = client
        groups = batches.setdefault(key, [[]])
        nbytes = int(getattr(out, "nbytes", 0))
        if len(groups[-1]) >= 256 or (groups[-1] and sizes.get(key, 0) + nbytes > 256 << 20):
            groups.append([])
            sizes[key] = 0
        groups[-1].append((name, box, out))
        sizes[key] = sizes.get(key, 0) + nbytes
    work = [(clients[k[0]], k[1], k[2], g) for k, gs in batches.items() for g in gs]
    _all([partial(c.read_boxes, job, step, g, save_id, sums) for c, job, step, g in work], concurrency)


def relay_many(
    requests: Iterable[tuple[StoreClient, str, str, Box | None, np.ndarray]],
    job: str,
    step: int,
    concurrency: int = 8,
    save_id: str | None = None,
) -> None:
    """Relayed reads (client of this host's store, peer URL, blob, box, out): one `fetch_remote_many`
    per (store, peer) and batch, at most `concurrency` in flight."""
    calls = [
        partial(c.fetch_remote_many, peer, job, step, part, save_id)
        for c, peer, part in _relay_batches(requests)
    ]
    _all(calls, concurrency)


def hold_relayed_many(
    requests: Iterable[tuple[StoreClient, str, str, Box, str]],
    job: str,
    step: int,
    concurrency: int = 8,
    save_id: str | None = None,
) -> list[tuple[Held, list[int]]]:
    """`hold_relayed` for (client of this host's store, peer URL, blob, box, dtype), batched as `relay_many`:
    one hold per batch, each with the positions in `requests` of its arrays. On an error every hold made is
    ended before it is raised."""
    numbered = [(c, peer, name, box, (dtype, i)) for i, (c, peer, name, box, dtype) in enumerate(requests)]
    work = _relay_batches(numbered)
    holds: list[tuple[Held, list[int]] | None] = [None] * len(work)

    def one(k: int) -> None:
        c, peer, part = work[k]
        h = c.hold_relayed(peer, job, step, [(n, b, dt) for n, b, (dt, _) in part], save_id)
        holds[k] = (h, [i for _, _, (_, i) in part])

    try:
        _all([partial(one, k) for k in range(len(work))], concurrency)
    except BaseException:
        for made in holds:
            if made is not None:
                made[0].close()
        raise
    return [made for made in holds if made is not None]


def _relay_batches(
    requests: Iterable[tuple[StoreClient, str, str, Any, Any]],
) -> list[tuple[StoreClient, str, list]]:
    """(client, peer, items of at most RELAY_BATCH) per (store, peer), items in request order."""
    groups: dict[tuple[int, str], list[tuple[str, Any, Any]]] = {}
    clients: dict[int, StoreClient] = {}
    for c, peer, name, box, extra in requests:
        clients[id(c)] = c
        groups.setdefault((id(c), peer), []).append((name, box, extra))
    return [(clients[k], peer, items[i : i + RELAY_BATCH])
            for (k, peer), items in groups.items() for i in range(0, len(items), RELAY_BATCH)]  # fmt: skip


def _all(calls: list[Callable[[], None]], concurrency: int) -> None:
    """Run every call, at most `concurrency` at once; then raise the first error (all have ended by then,
    so no call still writes into a caller's array)."""
    each(lambda call: call(), calls, max(1, concurrency))
