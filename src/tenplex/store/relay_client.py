"""A client's side of the relay: another host's blobs read through this host's store, which fetches each
box once for all the ranks of its host (the store's side is `relay`)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from ..ptc import Box
from .errors import BadRequestError, StoreError
from .keys import check_job, check_name, check_step
from .read_body import into
from .same_host import Held, Item, SameHost
from .transport import Transport

RELAY_BATCH = 256  # boxes in one relay request


class Relay:
    """Relayed reads of one client: copied into the caller's arrays, or held in this host's store."""

    def __init__(self, transport: Transport, same_host: SameHost) -> None:
        self.transport = transport
        self.same_host = same_host

    def fetch_many(
        self,
        peer_url: str,
        job: str,
        step: int,
        items: Sequence[tuple[str, Box | None, np.ndarray]],
        save_id: str | None = None,
    ) -> None:
        """(name, box, out) of one peer's version: one relay request per batch; the store fetches what it
        lacks of a batch in batched reads over one connection."""
        for name, box, out in items:
            check_name(name)
            if box is not None and tuple(out.shape) != box.shape:
                raise BadRequestError(f"out for {name!r} must have the box's shape {list(box.shape)}")
        for start in range(0, len(items), RELAY_BATCH):
            part = items[start : start + RELAY_BATCH]
            payload = self.payload(peer_url, job, step, part, save_id)
            if not self.transport.is_local:
                self.transport.request("POST", "/v1/relay", payload, reader=into([o for _, _, o in part]))
                continue
            leased = self.transport.lease("POST", "/v1/relay", payload)
            try:
                for info, (name, _, out) in zip(leased.answer["blobs"], part, strict=True):
                    whole = Box.full(tuple(info["shape"]))
                    self.same_host.copy(info, whole, out, f"relay {peer_url} {job}@{step}/{name}")
            finally:
                self.transport.end_lease(leased)

    def hold(
        self, peer_url: str, job: str, step: int, items: Sequence[Item], save_id: str | None = None
    ) -> Held:
        """Boxes of another host's store (blob, box, expected dtype), verified in this host's store and held
        there (see `StoreClient.hold_relayed`)."""
        self.same_host.check_holdable(items, "read relayed boxes with fetch_remote_many")
        if len(items) > RELAY_BATCH:
            raise BadRequestError(f"at most {RELAY_BATCH} relayed boxes per hold, {len(items)} asked")
        if not items:
            return Held([], lambda: None)
        leased = self.transport.lease("POST", "/v1/relay", self.payload(peer_url, job, step, items, save_id))
        try:
            for info, (name, box, _) in zip(leased.answer["blobs"], items, strict=True):
                if tuple(info["shape"]) != box.shape:
                    raise StoreError(f"relay of {name!r} answered shape {info['shape']} for box {box}")
        except BaseException:  # nothing is handed out: the lease ends here
            self.transport.end_lease(leased)
            raise
        whole = [(name, Box.full(box.shape), dtype) for name, box, dtype in items]  # a relay blob is its box
        release = partial(self.transport.end_lease, leased)
        return self.same_host.held(leased.answer["blobs"], whole, release, f"relay {peer_url} {job}@{step}")

    def drop(self, job: str, step: int, wait: bool = True) -> int | None:
        """Free the relay cache entries of (job, step); returns how many were dropped. `wait=False` sends
        the request without waiting for its answer (None; read by the connection's next user)."""
        payload = {"job": check_job(job), "step": check_step(step)}
        if not wait:
            self.transport.send_only("POST", "/v1/relay/drop", payload)
            return None
        return self.transport.request("POST", "/v1/relay/drop", payload)["dropped"]

    def payload(
        self,
        peer_url: str,
        job: str,
        step: int,
        part: Sequence[tuple[str, Box | None, Any]],
        save_id: str | None,
    ) -> dict[str, Any]:
        return {
            "peer": peer_url, "job": check_job(job), "step": check_step(step),
            "local": self.transport.is_local,
            "boxes": [{"name": n, "box": None if b is None else b.to_json()} for n, b, _ in part],
            "save_id": save_id,
        }  # fmt: skip
