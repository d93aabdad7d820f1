"""What an agent watches while a round trains, once a second (`Agent._supervise`): its members' beacons (one
silent as long as torch's rendezvous takes to drop a node is lost), the round's loaded mark, the durable
tier's persists, and what its own beacon says; and, when a worker's collective broke, which members'
stores refuse connections (lost at once, not after their heartbeats lapse).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import rendezvous
from .agentconfig import AgentConfig
from .beacon import Beacon
from .channel import put
from .durable_tier import EveryNth
from .membership import Membership
from .record_types import FoundLost, RoundLoaded
from .records import Records
from .rounds import Round, StoreEntry, has, job_key
from .workers import Workers

Heard = dict[str, tuple[Any, float]]  # per store: what its agent's beacon last said, and since when


def silent(base: dist.Store, run_id: str, url: str, heard: Heard, limit: float) -> bool:
    """Whether the agent of the store at `url` said nothing new in its beacon for `limit` seconds, by what
    `heard` holds from earlier looks (updated here)."""
    key, now = job_key(run_id, "agent", url), time.monotonic()
    said = base.get(key) if has(base, key) else None
    before = heard.get(url)
    if before is None or before[0] != said:
        heard[url] = (said, now)
        return False
    return now - before[1] > limit


class Watch:
    """The agent's looks at its round (`runtime/agent.py`'s `Agent` is one)."""

    cfg: AgentConfig
    base: dist.Store | None
    entry: StoreEntry
    members: Membership
    handler: Any
    workers: Workers
    records: Records
    heard: Heard
    silent_s: float
    marked: int
    tier: EveryNth | None
    status: dict[str, Any]
    beacon: Beacon | None

    def _mark_refused(self, rnd: Round) -> None:
        """A worker's collective broke: the members whose store refuses connections (no process listens
        on its port: the host's processes are gone) are marked lost in this round, so the next one forms
        without waiting for them (torch's last call, or their heartbeats to lapse). A member merely slow
        or cut off is left to the heartbeats: if it lives, it joins the round after."""
        assert self.base is not None
        gone = self.members.refused(rnd.stores)
        for i in gone:
            put(self.base, job_key(self.cfg.run_id, "lost", rnd.number, rnd.stores[i]), "1")
            self.records.write(FoundLost(rnd.number, rnd.stores[i]))
        if gone:
            rendezvous.drop(self.handler, set(gone))

    def _mark_loaded(self, rnd: Round) -> None:
        """Node 0, once the round's ranks loaded: a host that left before it may stop its store now."""
        if rnd.node_rank == 0 and self.marked < rnd.number and self.workers.ready(rnd):
            self.marked = rnd.number
            put(self.base, job_key(self.cfg.run_id, "loaded"), str(rnd.number))
            self.records.write(RoundLoaded(rnd.number))

    def _beat(self, rnd: Round) -> str | None:
        """Once a second: the round's loaded mark (node 0); the first member whose agent's beacon said
        nothing for as long as torch's rendezvous takes to drop a node (a host cut off: its workers'
        peers would wait on it in a collective, where no error comes)."""
        assert self.base is not None
        self._mark_loaded(rnd)
        if rnd.node_rank == 0 and self.cfg.persist_every:
            self._persist(rnd)
        others = [url for url in rnd.stores if url != self.entry.url]
        return next(
            (u for u in others if silent(self.base, self.cfg.run_id, u, self.heard, self.silent_s)), None
        )

    def _persist(self, rnd: Round) -> None:
        """Node 0, once a second: the durable tier takes every Nth snapshot (`--persist-every`)."""
        job = self.workers.job(rnd)
        if job is not None and self.cfg.persist_dir is not None:
            if self.tier is None:
                self.tier = EveryNth(Path(self.cfg.persist_dir), self.cfg.persist_every, self.records)
            self.tier.look(job, self.entry.url)

    def _status(self, rnd: Round) -> None:
        self.status = {
            "host": self.cfg.advertise,
            "store": self.entry.url,
            "round": rnd.number,
            "node": rnd.node_rank,
            "nodes": rnd.nodes,
            "world": rnd.world,
            "workers": self.workers.pids(rnd),
            "devices": rnd.devices,
        }
        if self.beacon is None:
            assert self.base is not None
            key = job_key(self.cfg.run_id, "agent", self.entry.url)
            self.beacon = Beacon(self.base, key, lambda: self.status)
