"""`StoreClient`: one interface, two paths — shared memory when the store is on this host, sockets otherwise.

Reads always land in caller-provided arrays (no intermediate `bytes`); connections are pooled and reused;
connection failures are retried with backoff (every request is idempotent); checksums are computed at write
and verified on every read, on whichever side touches the bytes.

A client is made of parts: its `transport` (connections, retries), the same-host side `local` (mappings of
the store's files), the `relay` and the `datasets` routes; versions and blobs are its own methods.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Unpack
from urllib.parse import quote

import numpy as np

from ..ptc import Box
from .dataset_client import Datasets
from .errors import BadRequestError, NotFoundError, StoreUnavailable
from .keys import (
    blob_path,
    check_job,
    check_name,
    save_query,
    version_path,
)
from .mappings import Mappings
from .read_body import into
from .relay_client import Relay
from .same_host import Held, Item, SameHost
from .transport import DEFAULT_PORT, DEFAULT_URL, Transport
from .writer import BlobWriter, SaveOf

__all__ = ["DEFAULT_PORT", "DEFAULT_URL", "Held", "StoreClient"]

BoxRequest = tuple[str, Box, np.ndarray]  # (blob name, box, out)


def _of_transport(name: str) -> Any:
    """An attribute of the client that is its transport's (set there too)."""
    return property(lambda c: getattr(c.transport, name), lambda c, v: setattr(c.transport, name, v))


class StoreClient:
    """Client of one store daemon: versions, blobs, relay, datasets, over pooled connections with retries.
    Thread-safe: concurrent calls use separate connections."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        local: bool | None = None,
        timeout: float = 120.0,
        retries: int = 3,
    ) -> None:
        self.transport = t = Transport(url, token, local, timeout, retries)
        self.request = t.request  # the transport's own: no layer between a call and its bytes
        self.maps = Mappings()
        self.same_host = SameHost(t, self.maps)
        self.relay = Relay(t, self.same_host)
        self.writer = BlobWriter(t, self.same_host)
        self.dataset = Datasets(t, self.maps)

    url = _of_transport("url")
    host = _of_transport("host")
    port = _of_transport("port")
    token = _of_transport("token")
    timeout = _of_transport("timeout")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, local={self.transport.local})"

    @property
    def is_local(self) -> bool:
        """Whether the daemon shares this machine's memory (decided once, from its `/v1/local` answer)."""
        return self.transport.is_local

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health")

    def close(self) -> None:
        """Close pooled connections and cached mappings (the client stays usable)."""
        self.transport.close()
        self.maps.clear()

    # ------------------------------------------------------------------ control

    def stats(self) -> dict[str, Any]:
        return self.request("GET", "/v1/stats")

    def jobs(self) -> list[str]:
        return self.request("GET", "/v1/jobs")["jobs"]

    def version_info(self, job: str) -> list[dict[str, Any]]:
        """Every version of `job`, committed or not, with blob counts, sizes and replication state."""
        answer = self.request("GET", f"/v1/jobs/{check_job(job)}")
        versions = answer.get("versions") if isinstance(answer, dict) else None
        if not isinstance(versions, list):  # not a store's answer (another process on its port): no store
            raise StoreUnavailable(f"{self.url} did not answer as a store (no version listing)")
        return versions

    def versions(self, job: str) -> list[int]:
        """Committed steps of `job`, ascending ([] for an unknown job)."""
        try:
            return [v["step"] for v in self.version_info(job) if v["committed"]]
        except NotFoundError:
            return []

    def save_ids(self, job: str) -> dict[int, str | None]:
        """Committed steps of `job` and the save id each was committed with."""
        try:
            return {v["step"]: v.get("save_id") for v in self.version_info(job) if v["committed"]}
        except NotFoundError:
            return {}

    def committed_saves(self, job: str) -> dict[int, list[str | None]]:
        """Every committed save of `job` a read can name here, by step (newest first): a step being saved
        again keeps its earlier save readable beside the new one until the new one is known complete."""
        try:
            listing = self.version_info(job)
        except NotFoundError:
            return {}
        out = {v["step"]: list(v.get("saves", [v.get("save_id")] if v["committed"] else [])) for v in listing}
        return {s: ids for s, ids in out.items() if ids}

    def latest(self, job: str) -> int | None:
        steps = self.versions(job)
        return steps[-1] if steps else None

    def create_version(
        self, job: str, step: int, save_id: str | None = None, replica_of: str | None = None
    ) -> dict[str, Any]:
        """Open version `step` for the save `save_id` (an open version of another save, an abandoned
        attempt, is replaced); `replica_of`: a copy of that store's save (replication)."""
        payload = {k: v for k, v in (("save_id", save_id), ("replica_of", replica_of)) if v is not None}
        return self.request("POST", version_path(job, step), payload or None)

    def commit(
        self,
        job: str,
        step: int,
        manifest: Any,
        wait_replicas: bool = False,
        replica_of: str | None = None,
        blobs: list[str] | None = None,
        save_id: str | None = None,
    ) -> dict[str, Any]:
        """Make version `step` visible with its manifest, atomically; idempotent. With replication on,
        `wait_replicas=True` returns only after the copies are on the peers (asked in rounds shorter than
        the client's timeout, so a long push is never mistaken for a dead store and the commit retried).
        `blobs`: the names that make the version (each must be sealed); others, left by an abandoned
        attempt, are dropped. `save_id` (default: the manifest's) must be the one the version was opened
        for."""
        wait = self.timeout / 4 if wait_replicas else False  # a round always ends well inside the timeout
        payload: dict[str, Any] = {"manifest": manifest, "wait_replicas": wait, "replica_of": replica_of}
        if blobs is not None:
            payload["blobs"] = blobs
        if save_id is not None:
            payload["save_id"] = save_id
        info = self.request("POST", f"{version_path(job, step)}/commit", payload)
        while wait and info.get("replication") == "pending":  # committed; the copies are still on the way
            info = self.request("POST", f"{version_path(job, step)}/commit", payload)
        return info

    def manifest(self, job: str, step: int, save_id: str | None = None) -> Any:
        path = f"{version_path(job, step)}/manifest{save_query(save_id)}"
        return self.request("GET", path)["manifest"]

    def blobs(self, job: str, step: int, save_id: str | None = None) -> list[dict[str, Any]]:
        """Blobs of a committed version (of the save `save_id`, default the one the store shows): name,
        dtype, shape, nbytes, copies (URLs of stores holding it)."""
        return self.request("GET", f"{version_path(job, step)}/blobs{save_query(save_id)}")["blobs"]

    def blob_info(self, job: str, step: int, name: str, save_id: str | None = None) -> dict[str, Any]:
        return self.request("GET", blob_path(job, step, name) + save_query(save_id))

    def delete_version(self, job: str, step: int, save_id: str | None = None) -> None:
        """Delete the step (every save and copy of it here); with `save_id`, only this store's open
        version of that save (a save that failed), leaving the step's committed save."""
        self.request("DELETE", version_path(job, step) + save_query(save_id, "?"))

    def delete_job(self, job: str) -> None:
        self.request("DELETE", f"/v1/jobs/{check_job(job)}")

    def retain(
        self,
        job: str,
        keep: int | None,
        protect: tuple[int, str | None] | None = None,
        replica_of: str | None = None,
    ) -> list[int]:
        """Keep the `keep` newest committed saves of `job` by commit order, and always `protect` (step,
        save id): the save just committed on every store, marked complete (`keep=None`: only that mark,
        and abandoned attempts before it dropped); without `protect`, the newest save ever marked
        complete is kept in its place, and nothing committed goes while none is. The store applies the
        same to its copies on its replication targets. `replica_of`: only that store's copies here.
        Returns the deleted steps."""
        shield = None if protect is None else list(protect)
        payload = {"keep": keep, "protect": shield, "replica_of": replica_of}
        return self.request("POST", f"/v1/jobs/{check_job(job)}/retain", payload)["deleted"]

    def delete_copy(self, job: str, step: int, replica_of: str, save_id: str) -> bool:
        """Delete `replica_of`'s copy of save `save_id` here (a partial push); it is never recreated."""
        q = f"?replica_of={quote(replica_of, safe='')}" + save_query(save_id, "&")
        return self.request("DELETE", version_path(job, step) + q)["deleted"] is not None

    def set_peers(self, peers: Sequence[str], replicas: int) -> list[str]:
        """Configure the store's replication ring; returns the peers it will copy committed versions to."""
        return self.request("POST", "/v1/peers", {"peers": list(peers), "replicas": replicas})["targets"]

    # ------------------------------------------------------------------ writing (`writer`)

    def write_blob(
        self,
        job: str,
        step: int,
        name: str,
        array: np.ndarray,
        dtype: str | None = None,
        save_id: str | None = None,
    ) -> None:
        """Store `array` (C order) as blob `name` of the uncommitted version `step` (of the save `save_id`);
        `dtype` names the tenplex dtype when numpy has none (bfloat16 passed as a 2-byte integer array)."""
        self.writer.write(job, step, name, array, dtype, save_id)

    def write_blobs(
        self,
        job: str,
        step: int,
        items: Sequence[tuple[str, np.ndarray, str | None]],
        save_id: str | None = None,
    ) -> None:
        """`write_blob` for many (name, array, dtype) at once: on this host one allocate and one seal
        request for all of them, each blob copied and checksummed chunk by chunk in one pass; over the
        network one PUT each."""
        self.writer.write_many(job, step, items, save_id)

    def put_raw(
        self,
        job: str,
        step: int,
        name: str,
        dtype: str,
        shape: Sequence[int],
        pieces: Sequence[memoryview],
        digests: list[int],
        **save: Unpack[SaveOf],
    ) -> None:
        """Network write of raw C-order bytes in CHUNK-sized pieces; the daemon refuses them unless it
        hashed them as we did. `replica_of`: the store this blob is a copy of (replication)."""
        self.writer.put(job, step, name, dtype, shape, pieces, digests, **save)

    def allocate_blob(
        self, job: str, step: int, name: str, dtype: str, shape: Sequence[int], save_id: str | None = None
    ) -> np.ndarray:
        """Same host only: a writable array mapped on the blob's shared memory; fill it, then `seal_blob`."""
        return self.writer.allocate(job, step, name, dtype, shape, save_id)

    def seal_blob(self, job: str, step: int, name: str) -> None:
        """Declare an allocated blob fully written: its checksums are taken now (sealed as the save it was
        allocated for: the store refuses it if that save's version was replaced meanwhile)."""
        self.writer.seal(job, step, name)

    # ------------------------------------------------------------------ reading

    def read_box(
        self, job: str, step: int, name: str, box: Box, out: np.ndarray, save_id: str | None = None
    ) -> None:
        """Copy `box` of a committed blob into `out` (C-contiguous, shape == box.shape)."""
        self.read_boxes(job, step, [(name, box, out)], save_id)

    def read_boxes(
        self,
        job: str,
        step: int,
        requests: Sequence[BoxRequest],
        save_id: str | None = None,
        sums: dict[int, list[int]] | None = None,
    ) -> None:
        """Many boxes of one version in one request (same host: one lookup, then memory copies). With
        `save_id`, only that save's blobs are read (NotFoundError if the store holds another one). On an
        error the contents of the `out` arrays are undefined. `sums`: see `read_body.into` (network
        reads only)."""
        for name, box, out in requests:
            check_name(name)
            if not isinstance(out, np.ndarray) or tuple(out.shape) != box.shape:
                raise BadRequestError(f"out for {name!r} must be an array of shape {list(box.shape)}")
        if not requests:
            return
        if self.is_local:
            by_name, release = self.same_host.locate(job, step, [r[0] for r in requests], save_id)
            try:
                for name, box, out in requests:
                    self.same_host.copy(by_name[name], box, out, f"{job}@{step}/{name}")
            finally:
                release()
            return
        payload = {"boxes": [{"name": n, "box": b.to_json()} for n, b, _ in requests], "save_id": save_id}
        self.request(
            "POST", f"{version_path(job, step)}/read", payload, reader=into([r[2] for r in requests], sums)
        )

    def hold_boxes(
        self, job: str, step: int, requests: Sequence[tuple[str, Box, str]], save_id: str | None = None
    ) -> Held:
        """Same host only: verify the chunks under every (blob, box, expected dtype) and keep the blobs
        held, so that the caller copies the boxes straight from shared memory into its own tensors later
        (`Held.arrays`, read-only views). A load writes its targets only once every rank verified its boxes;
        holding them spares the copy into scratch memory meanwhile, and fresh memory is what costs on a
        virtual machine (see docs/transformer.md). The bytes copied are the bytes verified: a held blob is
        sealed and its file is never recycled until `Held.close()` ends the hold."""
        self.same_host.check_holdable(requests, "read its boxes with read_boxes")
        if not requests:
            return Held([], lambda: None)
        by_name, release = self.same_host.locate(job, step, [r[0] for r in requests], save_id)
        return self.same_host.held([by_name[r[0]] for r in requests], requests, release, f"{job}@{step}")

    def hold_relayed(
        self, peer_url: str, job: str, step: int, items: Sequence[Item], save_id: str | None = None
    ) -> Held:
        """`hold_boxes` for boxes of another host's store (blob, box, expected dtype): this host's store
        fetches each once (as `fetch_remote_many`), the boxes are verified in its memory and held there,
        so the caller copies them into its tensors later without landing them in scratch memory first."""
        return self.relay.hold(peer_url, job, step, items, save_id)

    def fetch_remote(
        self,
        peer_url: str,
        job: str,
        step: int,
        name: str,
        box: Box | None,
        out: np.ndarray,
        save_id: str | None = None,
    ) -> None:
        """Relay: have *this* client's store fetch `box` (None: the whole blob) of a blob held by the store at
        `peer_url` once, cache it, and serve it from there — so ranks of one host that need the same remote
        bytes move them across the network once. The cache lives until the local store's version
        (job, step) is deleted or `drop_relay(job, step)` is called."""
        self.relay.fetch_many(peer_url, job, step, [(name, box, out)], save_id)

    def fetch_remote_many(
        self,
        peer_url: str,
        job: str,
        step: int,
        items: Sequence[tuple[str, Box | None, np.ndarray]],
        save_id: str | None = None,
    ) -> None:
        """`fetch_remote` for many (name, box, out) of one peer's version: one relay request per batch, and
        the store fetches what it lacks of a batch in batched reads over one connection."""
        self.relay.fetch_many(peer_url, job, step, items, save_id)

    def drop_relay(self, job: str, step: int, wait: bool = True) -> int | None:
        """Free the relay cache entries of (job, step); returns how many were dropped. `wait=False` sends
        the request without waiting for its answer (None; read by the connection's next user)."""
        return self.relay.drop(job, step, wait)

    # ------------------------------------------------------------------ datasets (`dataset_client`)

    def register_dataset(
        self, name: str, corpus_dir: str | os.PathLike, split: str = "train", *, seq: int
    ) -> dict:
        """Have the store map `corpus_dir` (a `build_corpus` directory *on the store's host*; made absolute
        here) read-only under `name`; returns its info (tokens, num_samples, ...). Re-registering replaces."""
        return self.dataset.register(name, corpus_dir, split, seq=seq)

    def datasets(self) -> list[dict[str, Any]]:
        return self.dataset.listing()

    def dataset_info(self, name: str) -> dict[str, Any]:
        return self.dataset.info(name)

    def drop_dataset(self, name: str) -> None:
        self.dataset.drop(name)

    def dataset_ids(
        self, name: str, sampler_state: dict[str, int], dp: int, rank: int, steps: int = 1
    ) -> list[np.ndarray]:
        """Rank `rank` of `dp`'s sample ids for the next `steps` global batches from the position in
        `sampler_state` (`ElasticSampler.state_dict()`), as the store's `ElasticSampler` computes them."""
        return self.dataset.ids(name, sampler_state, dp, rank, steps)

    def read_samples(self, name: str, ids: Sequence[int] | np.ndarray, out: np.ndarray) -> None:
        """Token windows `ids` ([n, seq+1], sample i = tokens[i*seq : i*seq+seq+1]) into `out` (C-contiguous,
        the corpus dtype). Same host: gathered straight from this process's read-only map of the corpus file;
        otherwise the store sends the raw bytes."""
        self.dataset.read_samples(name, ids, out)

    def rank_samples(
        self, name: str, sampler_state: dict[str, int], dp: int, rank: int, steps: int = 1
    ) -> list[np.ndarray]:
        """`dataset_ids` then `read_samples`: rank `rank`'s token windows of the next `steps` batches."""
        return self.dataset.rank_samples(name, sampler_state, dp, rank, steps)
