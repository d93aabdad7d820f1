"""`tenplex agent`: one per host, torch's elastic rendezvous for membership, workers kept across rounds.

torchrun restarts every worker on every membership change (an interpreter, a torch import, the script's
build, per worker). The agent keeps them: it starts (or attaches to) its host's store, forks its workers
once (`runtime/worker.py`), and per rendezvous round tells each its rank, world size and master through a
TCPStore on loopback. A change is noticed by any agent (a node waiting to join, an agent leaving, a worker
whose collective broke because a host was lost, `tenplex stop`) and published in the rendezvous store;
every worker stops at its next step boundary (its `ElasticJob.running` asks its agent), saves, destroys
its group and waits in process while the agents form the next round (a change planned at a step: its
round is built ahead by other workers while the last steps train, `agent_hand.py`). The round's stores
come from the rendezvous, each agent's store replicates to the next agent's (a ring), so a lost host's
newest snapshot has a copy elsewhere. Membership is torch's (`DynamicRendezvousHandler`, c10d or etcd),
not tenplex's.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError

from ..store.process import StoreProcess
from ..util import env, logs
from . import rendezvous
from .agent_hand import PARK_TIMEOUT_S, Handing
from .agent_store import host_store, ring
from .agent_watch import Watch
from .agentconfig import AgentConfig
from .asked import admitted, asked_at, asked_devices, asked_layout, failed_devices, offer, stop_asked
from .beacon import Beacon
from .channel import put
from .durable_tier import EveryNth
from .membership import Membership
from .record_types import Change, End, Left, RoundFormed, Standby
from .records import Records
from .rounds import (
    AgentError,
    Round,
    StoreEntry,
    connect,
    get_json,
    has,
    job_key,
    known_stores,
    register_store,
)
from .workers import Workers

log = logs.get("agent")

# after a round broke (a worker failed, a host was lost or cut off), the wait for its workers to park: one
# still in a collective then may wait forever (gloo cannot abort one); the others park within their commit
# grace (worker.py)
BROKEN_PARK_S = 0.5  # (a replacement is a fork of the host's zygote: a fraction of a second)
RDZV_LEAD_S = 0.5  # a planned change's next round forms this long before the workers reach its step
AHEAD_LEAD_S = 3.0  # the same where it is handed ahead: its workers build and rehearse meanwhile
ASK_SETTLE_S = 0.3  # ... once the change was asked this long ago (the asks of one event come together)
LINGER_S = 120.0  # a leaving agent keeps its store this long at most, until the next round has loaded


class Agent(Watch, Handing):
    workers: Workers  # made in `run`

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.records = Records(self.run_dir / "agent.jsonl")
        self.started: StoreProcess | None = None
        self.leaving = False
        self.left_said = False  # `left/URL` written (once: a leave waiting for its step looks again)
        self.closing: str | None = None  # then `closed/N/URL`, to write once its workers are out (`_closed`)
        self.restarts = 0
        self.base: dist.Store | None = None
        self.heard: dict[str, tuple[Any, float]] = {}  # per member: what its agent last said, and when
        # when the round broke (a worker failed, a member fell silent), else 0
        self.broken = 0.0
        self.status: dict[str, Any] = {}  # what the beacon says of this agent (`_status`)
        self.marked = 0  # the newest round this agent marked loaded
        self.beacon: Beacon | None = None
        self.silent_s = 3.0  # a member silent this long is lost (torch's heartbeat expiry, set in run)
        self.tier: EveryNth | None = None  # node 0's persists (--persist-every), once the job is known
        self.told: tuple[int, int | None] | None = None  # the round its workers were told to stop, and at
        self.told_at = 0.0  # when (monotonic)
        self.ahead = False  # whether a planned change's round is handed to workers forked ahead (in run)
        self.failures = -1  # devices said failed here, as counted when it joined (earlier ones are not its)

    # -- the rendezvous ---------------------------------------------------------------------------

    def _rendezvous(self, ahead: bool = False) -> tuple[Round, list[str]]:
        """Join the next round; every agent's store entry and slots; the round's group master. `ahead`:
        this agent would hand the round ahead (`_hand_ahead`); the round is then handed ahead on every
        host (its ranks build, and rehearse, before they load) where every host that stays says so."""
        t = time.time()
        expected = self.members.expected(self.base, self.handler.num_nodes_waiting())
        with rendezvous.expecting(self.handler, expected):
            info = self.handler.next_rendezvous()
        rs, node, nodes = info.store, info.rank, info.world_size
        self.base = rs.underlying_store
        run_id = self.cfg.run_id
        register_store(self.base, run_id, self.entry)
        if self.failures < 0:
            self.failures = failed_devices(self.base, run_id, self.entry.url)[1]
        self.base.delete_key(job_key(run_id, "left", self.entry.url))  # back on its port: a member again
        devices = self._wanted()
        self.workers.grow(devices)
        ahead = ahead or (self.ahead and not self.members.last_stores)  # a new host: if the round is new
        said = {"store": self.entry.to_json(), "nproc": len(devices), "ahead": ahead}
        put(rs, f"tenplex/node/{node}", json.dumps(said))
        if node == 0:  # one layout for the whole round: what was asked when it formed
            put(rs, "tenplex/layout", asked_layout(self.base, run_id))
            put(rs, "tenplex/round", str(self.base.add(job_key(run_id, "rounds"), 1)))
        members = [json.loads(rs.get(f"tenplex/node/{i}")) for i in range(nodes)]
        number = int(rs.get("tenplex/round"))
        entries = [StoreEntry.from_json(m["store"]) for m in members]
        if node == 0:  # whom a round of new hosts only waits for (`_hand`)
            put(self.base, job_key(run_id, "members", number), json.dumps([e.url for e in entries]))
        key = job_key(run_id, "members", number - 1)
        before = get_json(self.base, key) if has(self.base, key) else []
        stay = [m for m, e in zip(members, entries, strict=True) if e.url in before]
        # handed ahead where every host that stays says so (each knows how long its round has: one that
        # broke or has no time says no), or, new hosts only, where every host before left as planned
        left = bool(before) and all(has(self.base, job_key(run_id, "left", u)) for u in before)
        ahead = all(m["ahead"] for m in stay or members) and bool(stay or left)  # (a broken host says no)
        sizes = [int(m["nproc"]) for m in members]
        boot = info.bootstrap_store_info
        stores = [e.url for e in entries]
        sources = env.url_list(env.SOURCES) or [e.url for e in known_stores(self.base, run_id)]
        self.members.formed(self.base, number, stores)
        persist = str(Path(self.cfg.persist_dir).resolve()) if self.cfg.persist_dir else None
        gone = sorted(self.members.gone)
        master, layout = f"{boot.master_addr}:{boot.master_port}", rs.get("tenplex/layout").decode()
        retired = self.members.retired(self.base, sources, stores)
        rnd = Round(number, node, nodes, sum(sizes[:node]), sum(sizes), master, self.entry.url, stores,
                    sources, gone, persist, layout, devices, retired, ahead,
                    [] if stay else before)  # fmt: skip
        ring(self.entry.url, stores, min(self.cfg.replicas, nodes - 1))
        hosts = [e.host for e in entries]
        self.records.write(RoundFormed(number, node, nodes, rnd.world, stores, hosts, gone, devices,
                                       time.time() - t, rnd.retired))  # fmt: skip
        return rnd, [e.host + "|" + e.url for e in entries]

    def _request_change(self, rnd: Round, why: str, at: int | None = None, peers: bool = True) -> None:
        """Round `rnd` ends for `why`: at its workers' next step boundary, or after step `at` (a planned
        change asked for then; a broken round ends at once). Said to this host's workers (again only when
        the step changed), and once to the other agents (`peers`)."""
        assert self.base is not None
        at = None if self.broken else at
        if self.told != (rnd.number, at):
            self.told, self.told_at = (rnd.number, at), time.monotonic()
            self.workers.stop(rnd, why, bool(self.broken), at)
        if peers and not has(self.base, job_key(self.cfg.run_id, "change", rnd.number)):
            put(self.base, job_key(self.cfg.run_id, "change", rnd.number), why)
            self.records.write(Change(rnd.number, why, at))

    def _supervise(self, rnd: Round) -> str:
        """Watch the round until it ends: "done", "stop" (tenplex stop), "leave" or "change"."""
        beat, self.heard = 0.0, {}
        while True:
            time.sleep(self.cfg.monitor_interval)
            second = time.monotonic() - beat > 1.0
            if second:
                beat = time.monotonic()
                silent = self._beat(rnd)
                if silent:
                    self.broken = time.monotonic()  # its workers' peers may wait on it in a collective
                    assert self.base is not None  # the other agents expect the next round without it
                    put(self.base, job_key(self.cfg.run_id, "lost", rnd.number, silent), "1")
                    self._request_change(rnd, f"lost: the agent of {silent} fell silent")
                    return "change"
            why = self._why_end(rnd, asks=second)
            if why:
                return why

    def _why_end(self, rnd: Round, asks: bool) -> str | None:
        """Why the round ends, if it does: "done", "leave", "stop" (tenplex stop) or "change". `asks`:
        also what `tenplex devices` and `tenplex layout` asked (once a second: an ask waits for a step
        boundary anyway, and each look costs round trips to the rendezvous store)."""
        assert self.base is not None
        ended, run_id = self.workers.ended(rnd), self.cfg.run_id
        if len(ended) == len(rnd.devices) and all(e["outcome"] == "done" for e in ended.values()):
            return "done"
        if self.leaving:  # said before the change, so the others expect the next round without this node
            if not self.left_said:  # the round it left: once the next one loaded, its store stops
                self.left_said, self.closing = True, job_key(run_id, "closed", rnd.number, self.entry.url)
                put(self.base, job_key(run_id, "left", self.entry.url), str(rnd.number))
            return self._planned(rnd, "leave", "leave", ended)
        if stop_asked(self.base, run_id):
            return self._planned(rnd, "stop", "stop", ended)
        failed = {s: e["error"] for s, e in ended.items() if e["outcome"] in ("error", "dead")}
        failed.update(self.workers.broke(rnd))
        if failed:
            self.broken = time.monotonic()
            self._mark_refused(rnd)
            slot = min(failed)
            self._request_change(rnd, f"worker {slot}: {failed[slot]}")
            return "change"
        if ended and all(e["outcome"] == "done" for e in ended.values()):
            return None  # the job trained its last step: the others park with it (no change, no new round)
        # the same members go on: the others see a peer's change
        why = self._asked(rnd) if asks else None
        if why is None and (ended or has(self.base, job_key(run_id, "change", rnd.number))):
            why = "peer"
        if why is None and self.handler.num_nodes_waiting() > 0:
            why = "join"
        return None if why is None else self._planned(rnd, "change", why, ended)

    def _planned(self, rnd: Round, kind: str, why: str, ended: dict[int, Any]) -> str | None:
        """A planned end of the round (`kind`): at the step the job asked for (`--at-step`), else at the
        next step boundary. The workers are told now; the round ends once they stopped there (until then
        it trains on, and the added devices' workers warm meanwhile). The agents end it a rendezvous' time
        before (`AHEAD_LEAD_S` where the next round is handed ahead, once the asks of the change are all
        in): the next round forms while the last steps train and save, and loads only after that save
        (handed to the kept workers once they parked, or to workers built ahead on their turn; a round
        of new hosts only, a redeploy, once the old ones closed their round: `_hand`)."""
        assert self.base is not None
        at = asked_at(self.base, self.cfg.run_id)
        self._request_change(rnd, why, at, peers=kind != "stop")
        if at is None or ended:
            return kind
        lead = RDZV_LEAD_S  # (a stop ends the job)
        if self.ahead and kind != "stop" and time.monotonic() - self.told_at >= ASK_SETTLE_S:
            lead = AHEAD_LEAD_S
        return kind if self.workers.left_s(rnd) <= lead else None

    def _asked(self, rnd: Round) -> str | None:
        """What `tenplex devices` or `tenplex layout` asked that this round does not have, if anything;
        forks for added devices start at once (they warm while the round saves). Devices said failed
        (`tenplex devices --failed`) lose their workers now: the round breaks, as on a real failure."""
        assert self.base is not None
        failed, count = failed_devices(self.base, self.cfg.run_id, self.entry.url)
        if count > self.failures:
            self.failures = count
            self.workers.kill([d for d in failed if d in rnd.devices])
            return None  # the dead workers end the round on the next look
        wanted = self._wanted()
        if wanted != rnd.devices:
            self.workers.grow(wanted)
            return f"devices {rnd.devices} -> {wanted}"
        layout = asked_layout(self.base, self.cfg.run_id)
        return f"layout {rnd.layout or 'chosen'} -> {layout or 'chosen'}" if layout != rnd.layout else None

    def _wanted(self) -> list[int]:
        """This host's devices as `tenplex devices` last set them (`--nproc-per-node`'s until then)."""
        assert self.base is not None
        return asked_devices(self.base, self.cfg.run_id, self.entry.url) or list(range(self.cfg.nproc))

    def _park(self, rnd: Round) -> list[int]:
        """Every worker out of the round; after a round broke, those stuck in a collective wait only
        briefly, counted from the break (the next round's rendezvous ran meanwhile), before they are
        restarted (gloo cannot abort one)."""
        timeout = max(0.3, self.broken + BROKEN_PARK_S - time.monotonic()) if self.broken else PARK_TIMEOUT_S
        self.broken = 0.0  # (a round that breaks while its planned end is awaited: BROKEN_PARK_S from then)
        return self.workers.park(rnd, timeout, BROKEN_PARK_S)

    # -- the agent's life -------------------------------------------------------------------------

    def run(self) -> int:
        self._signals()
        self.entry, self.started = host_store(self.cfg, self.run_dir, self.records)
        self.members = Membership(self.cfg.run_id, self.entry.url)
        self.workers = Workers(self.cfg.target, self.cfg.nproc, self.cfg.run_id, self.run_dir, self.records)
        self.workers.warm()
        cfg = self.cfg
        # on accelerators the next round's workers would need the device's memory the old ones still hold
        self.ahead = cfg.ahead and not torch.cuda.is_available()
        settings = rendezvous.Settings(
            cfg.backend, cfg.endpoint, cfg.run_id, cfg.min_nodes, cfg.max_nodes, cfg.advertise, cfg.rdzv_conf
        )
        self.handler, self.silent_s = rendezvous.handler(settings)
        try:
            if cfg.standby and not self._admitted():
                return 0  # told to leave, or the job stopped, before it was let in
            return self._rounds()
        except (RuntimeError, RendezvousError) as e:  # the rendezvous store is gone, or cut off from here
            raise AgentError(f"lost the rendezvous at {self.cfg.endpoint}: {e}") from None
        finally:
            self._end()

    def _admitted(self) -> bool:
        """A warm spare (`--standby`) waits to join until `tenplex admit` names its store, so a join costs
        the job no start-up; False: it was told to leave (a signal), or the job stopped, first."""
        base, run_id, url = connect(self.cfg.endpoint), self.cfg.run_id, self.entry.url
        offer(base, run_id, url, True)
        self.records.write(Standby(url))
        try:
            while not self.leaving and not stop_asked(base, run_id):
                if admitted(base, run_id, url):
                    return True
                time.sleep(self.cfg.monitor_interval)
            return False
        finally:
            offer(base, run_id, url, False)

    def _rounds(self) -> int:
        rnd, members = self._rendezvous()
        handed = False  # whether `rnd` went to workers handed it ahead
        while True:
            if not handed:
                self._hand(rnd)
            self._status(rnd)
            why = self._supervise(rnd)
            if why == "leave":  # out of the rendezvous at once: the others' next round need not wait for us
                rendezvous.leave(self.handler)
                self._park(rnd)  # saved (or failed: nothing more comes from here either way)
                self._closed()
                return self._leave(rnd)
            if why in ("done", "stop"):
                self._park(rnd)
                self._mark_loaded(rnd)  # a round that ended within a beat: a host that left need not linger
                if self.handler is not None:
                    self.handler.shutdown()
                self.records.write(End(why, rnd.number))
                return 0
            # while the workers save, a round forms meanwhile
            new, new_members = self._rendezvous(ahead=self._ahead_pays(rnd))
            handed = self._hand_ahead(rnd, new)
            failed = self._park(rnd)
            if handed and not self._take_ahead(new, bool(failed)):
                handed = False  # its ranks, on other hosts too, may have formed its group: a round after it
                self._request_change(new, f"round {rnd.number} failed before its final save")
                new, new_members = self._rendezvous()
            lost = [m for m in members if m not in new_members]
            if failed and not lost:
                self.restarts += 1
                if self.restarts > self.cfg.max_restarts:
                    self.records.write(End("max_restarts", rnd.number))
                    self.handler.shutdown()
                    log.error(
                        "workers failed %d times (--max-restarts %d); see %s/worker-p*.log",
                        self.restarts,
                        self.cfg.max_restarts,
                        self.run_dir,
                    )
                    return 1
            rnd, members = new, new_members

    def _leave(self, rnd: Round) -> int:
        """A planned leave: the workers saved; they end, this node leaves the rendezvous, and the store
        stays until the next round has loaded (its shards of the newest snapshot may be needed)."""
        self.records.write(Left(rnd.number))
        deadline = time.monotonic() + LINGER_S
        assert self.base is not None
        key = job_key(self.cfg.run_id, "loaded")
        while time.monotonic() < deadline:
            try:
                if has(self.base, key) and int(self.base.get(key)) > rnd.number:
                    break
            except RuntimeError:  # the rendezvous store is gone: nothing will load from here
                break
            time.sleep(0.1)
        return 0

    def _closed(self) -> None:
        """A leaver's round is closed: its workers are out (saved, failed, or this agent ends); a round of
        new hosts only waits for it (`_hand`)."""
        if self.closing is not None and self.base is not None:
            with contextlib.suppress(RuntimeError):  # the rendezvous store is gone: nobody waits
                put(self.base, self.closing, "1")
            self.closing = None

    def _end(self) -> None:
        if self.beacon is not None:
            self.beacon.stop.set()
        if self.tier is not None:  # a checkpoint being written is finished, not left half-written
            self.tier.join()
        if hasattr(self, "workers"):
            self.workers.close()
        self._closed()  # a leaver told twice to go, before its workers parked: they are out now
        if self.started is not None and not self.cfg.keep_store:
            self.started.stop()

    def _signals(self) -> None:
        def leave(signum: int, frame: object) -> None:
            if self.leaving:  # a second signal: go now
                raise KeyboardInterrupt
            self.leaving = True
            log.warning("leaving the job at the next step boundary (signal %d again: at once)", signum)

        signal.signal(signal.SIGTERM, leave)
        signal.signal(signal.SIGINT, leave)
