"""An agent's own store: attached (`--store`, or the store an earlier agent left on this port) or started
in a session of its own, so it outlives the agent (a restarted agent finds its snapshots there); and its
replication pointed at the next store of each round (a ring)."""

from __future__ import annotations

import os
from pathlib import Path

from ..store import StoreError
from ..store.client import StoreClient
from ..store.process import StoreProcess, start_store
from ..util import env
from .agentconfig import AgentConfig
from .record_types import Store
from .records import Records
from .rounds import AgentError, StoreEntry


def host_store(cfg: AgentConfig, run_dir: Path, records: Records) -> tuple[StoreEntry, StoreProcess | None]:
    """The host's store as the job knows it (URL, incarnation, host), and its process when this agent
    started it (None: attached)."""
    if cfg.token_file:
        from ..store.auth import token_file

        os.environ[env.STORE_TOKEN] = token_file(cfg.token_file) or ""
    url, started = cfg.store or f"http://{cfg.advertise}:{cfg.store_port}", None
    try:
        health = StoreClient(url).health()
        records.write(Store(url, True, str(health["incarnation"])))
    except StoreError:
        if cfg.store:
            raise AgentError(f"no store answers at --store {cfg.store}") from None
        started = start_store(
            cfg.store_port,
            cfg.advertise,
            cfg.store_memory,
            cfg.token_file,
            extra=["--advertise", url],
            log=str(run_dir / "store.log"),
        )
        health = started.client().health()
        records.write(Store(url, False, str(health["incarnation"])))
    return StoreEntry(url, str(health["incarnation"]), cfg.advertise), started


def ring(url: str, stores: list[str], replicas: int) -> None:
    """The store at `url` copies each committed save to the next `replicas` of the round's `stores` (one
    copy by default), so no single lost host takes the newest snapshot with it."""
    try:
        StoreClient(url).set_peers(stores if replicas else [], replicas)
    except StoreError as e:
        raise AgentError(f"own store {url}: {e}") from None
