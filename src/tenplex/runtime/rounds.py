"""What an agent and its workers say to each other, and what agents say through the rendezvous store.

Two key spaces, both torch `Store`s (no files):

- the agent's own TCPStore on loopback, served by the agent for its workers: `cmd/INBOX/N` (a worker
  process's N-th command: a round to run in a slot, or the end), `warm/INBOX` (it imported what a rank
  needs), `stop/R` (round R stops at its next step
  boundary), `ready/R` (round R's ranks have loaded), `parked/R/SLOT` (a worker's round ended: `stopped`,
  `done` or `error` with its message);
- the job's keys in the rendezvous store (`tenplex/ID/...`, beside torch's own rendezvous state): every
  store the job has had (`store/I`), changes requested for a round (`change/R`), the status of each agent,
  `stop` from `tenplex stop`, the newest round whose workers have loaded (`loaded`), a host's devices
  (`devices/URL`, from `tenplex devices`) and the layout asked for (`layout`, from `tenplex layout`).

A `Round` is one membership of the job: which agents, in which order, the group's master, and the stores.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..ptc import TenplexError
from ..util import env
from .channel import put

AGENT = "TENPLEX_AGENT"  # host:port of this host's agent store (set by the agent for its workers)
INBOX = "TENPLEX_AGENT_INBOX"  # where this worker process's commands come (one per process started)
ROUND = "TENPLEX_ROUND"  # the round this worker runs (set per round)
AHEAD = "TENPLEX_AHEAD"  # "1": this round was handed ahead, while the one before still trains


class AgentError(TenplexError):
    """An agent cannot go on: a bad flag, a store it cannot start or reach, a rendezvous that failed."""


@dataclass(frozen=True)
class StoreEntry:
    """One store the job has had: its URL, the incarnation it answered in, and the agent's host."""

    url: str
    incarnation: str
    host: str

    @staticmethod
    def from_json(text: str | bytes) -> StoreEntry:
        return StoreEntry(**json.loads(text))

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass
class Round:
    """One round: this agent's place in it, the group's master, and the stores a snapshot may be in."""

    number: int  # the rendezvous round
    node_rank: int
    nodes: int
    rank_base: int  # global rank of this agent's first worker
    world: int
    master: str  # host:port of the round's process group (rank 0's TCPStore)
    store: str  # this agent's store
    stores: list[str]  # the round's stores, in node order (the replica ring)
    sources: list[str] = field(default_factory=list)  # every store a snapshot may be in, former ones too
    gone: list[str] = field(default_factory=list)  # stores of hosts lost (not left): counted lost unasked
    durable: str | None = None  # the agents' --persist-dir: checkpoints to fall back to
    layout: str = ""  # the layout the job asks for (`tenplex layout`), taken where the world fits it
    devices: list[int] = field(default_factory=list)  # this agent's devices, one worker each, in rank order
    retired: list[str] = field(default_factory=list)  # stores of hosts that left and stopped them since
    ahead: bool = False  # handed ahead: its ranks build while the round before trains, load on their turn
    after: list[str] = field(default_factory=list)  # no host stays: the stores of the round before (closed)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> Round:
        return Round(**json.loads(text))

    def environ(self, position: int, device: int, local_world: int) -> dict[str, str]:
        """The torchrun-style variables of the host's `position`-th worker in this round, on `device`, plus
        where its stores are. LOCAL_RANK is the device's index, not the position: a kept worker stays on
        its device when another device of its host is removed (its index then leaves a gap)."""
        host, port = self.master.rsplit(":", 1)
        out = {
            "RANK": str(self.rank_base + position),
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": str(device),
            "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
            env.STORE: self.store,
            ROUND: str(self.number),
        }
        out[env.SOURCES] = ",".join(dict.fromkeys([*self.stores, *self.sources]))
        out[env.LOST] = ",".join(dict.fromkeys([*self.gone, *self.retired]))
        out[env.LAYOUT] = self.layout  # set every round: a kept worker's environment holds the last one
        out[AHEAD] = "1" if self.ahead else ""
        if self.durable:
            out[env.DURABLE] = self.durable
        return out


def job_key(run_id: str, *parts: object) -> str:
    """A key of job `run_id` in the rendezvous store."""
    return "/".join(["tenplex", run_id, *map(str, parts)])


def connect(address: str, timeout: float = 30.0) -> dist.TCPStore:
    """A client of the TCPStore at host:port."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise AgentError(f"expected HOST:PORT, got {address!r}")
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:
        raise AgentError(f"no store answers at {address}: {e}") from None


def has(store: dist.Store, key: str) -> bool:
    return bool(store.check([key]))


def get_json(store: dist.Store, key: str) -> Any:
    return json.loads(store.get(key))


def register_store(base: dist.Store, run_id: str, entry: StoreEntry) -> None:
    """Add `entry` to the job's stores (once per URL and incarnation)."""
    if entry in known_stores(base, run_id):
        return
    i = base.add(job_key(run_id, "stores"), 1) - 1
    put(base, job_key(run_id, "store", i), entry.to_json())


def known_stores(base: dist.Store, run_id: str) -> list[StoreEntry]:
    """Every store the job has had, in the order they came (a registration under way is skipped)."""
    n = base.add(job_key(run_id, "stores"), 0)
    keys = [job_key(run_id, "store", i) for i in range(n)]
    return [StoreEntry.from_json(base.get(k)) for k in keys if has(base, k)]


def worker_agent() -> tuple[str, str] | None:
    """(agent address, inbox) when this process is a worker kept by a `tenplex agent`."""
    address, inbox = os.environ.get(AGENT), os.environ.get(INBOX)
    return (address, inbox) if address and inbox else None


_agent: list[dist.TCPStore] = []  # this worker's connection to its agent (made once)
_reached: list[bool] = []  # this round: whether the job ended at its last step (empty: not said)


def agent_store() -> dist.TCPStore | None:
    """This worker's agent's store; None when no agent started this process."""
    placed = worker_agent()
    if placed is None:
        return None
    if not _agent:
        _agent.append(connect(placed[0]))
    return _agent[0]


def ahead() -> bool:
    """Whether this worker's round was handed ahead: built while the round before it trains, it loads
    only once its agent gives the turn (`turn/R`, as under `tenplex run`)."""
    return os.environ.get(AHEAD) == "1" and worker_agent() is not None


def mark_ready(job: str) -> None:
    """Rank 0: the round's ranks have loaded (a leaving host's store is no longer needed); the job's name
    in the stores (what the agent persists)."""
    store, number = agent_store(), os.environ.get(ROUND)
    if store is not None and number:
        put(store, f"ready/{number}", job)


def records_dir(out: str | None) -> str | None:
    """Where a job's records go: `out`, or its `roundN` folder under an agent (each round's ranks write
    their own records and ledgers, as `tenplex run`'s phases do: a replayed step is counted once)."""
    number = os.environ.get(ROUND)
    return os.path.join(out, f"round{number}") if out and number and worker_agent() else out


def note_end(reached: bool) -> None:
    """The job's loop ended: at its last step (`reached`) or for a stop; the worker reports which."""
    _reached[:] = [reached]


def ended_at_last_step() -> bool | None:
    """What `note_end` said since `forget_end` (None: nothing, the script uses no `ElasticJob`)."""
    return _reached[0] if _reached else None


def forget_end() -> None:
    _reached.clear()
