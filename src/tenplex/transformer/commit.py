"""The commit of a save, written once: one manifest committed on every store the save wrote to.

Used by `tenplex.save` (rank 0, after every rank's blobs are in), and meant for every other writer of
snapshots (DCP's `StoreWriter`), so that a torn save is never read and either front door reads the other's.
"""

from __future__ import annotations

from typing import Any

from ..store import NotFoundError, StoreClient
from ..util import logs
from . import jobrecord
from .breakdown import Breakdown
from .errors import CheckpointExistsError
from .snapshot import stamp
from .stores import client

log = logs.get("transformer")


def commit(
    manifest: dict[str, Any], blobs: dict[str, list[str]], keep: int | None, bd: Breakdown | None = None
) -> dict[str, str]:
    """Commit `manifest` on each of its stores (`blobs`: what each must hold), note the job's stores on this
    host, then apply `keep`; returns each store's push to its replicas (done, failed: ..., none).

    Retention runs only once the save is committed everywhere: the save named is complete (each store
    marks it so, and never deletes the newest complete one); without `keep` nothing committed is deleted.
    A failed push does not fail the save: it is logged and returned."""
    bd = bd or Breakdown()
    job, step = manifest["job"], manifest["step"]
    replication: dict[str, str] = {}
    with bd.phase("commit"):
        stamp(manifest)  # each store's replica targets and incarnation
        for url in manifest["stores"]:
            info = client(url).commit(job, step, manifest, wait_replicas=True, blobs=blobs[url])
            replication[url] = str(info.get("replication", "none"))
        jobrecord.write(manifest)  # on this host: the stores the job's newest snapshot is on
    for url, state in replication.items():
        if state not in ("none", "done"):
            log.warning("save %s@%d is committed but its copies from %s are not: %s", job, step, url, state)
    with bd.phase("retain"):
        for url in manifest["stores"]:
            client(url).retain(job, keep, protect=(step, manifest.get("save_id")))
    return replication


def replace_committed(own: StoreClient, job: str, step: int, overwrite: bool) -> None:
    """For writers that carry no common save id (DCP's): a committed `step` is deleted before the new save
    of it, or, when `overwrite` is False, refused as DCP's file system refuses it."""
    if step in own.versions(job):
        if not overwrite:
            raise CheckpointExistsError(f"checkpoint {job}@{step} already exists and overwrite=False")
        try:
            own.delete_version(job, step)
        except NotFoundError:  # another rank on this host deleted it first
            pass
