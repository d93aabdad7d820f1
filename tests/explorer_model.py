"""Helpers of tests/test_explorer.py: emulated ranks, live store slots, squatters, and the pure model.

- `ThreadGroup`/`RankHandle`: ranks of one save emulated by threads of this process (the transformer's
  `world` is patched to dispatch on `RankHandle`; every other group goes to the real functions), so a
  save can span two stores the way a 2-rank `tenplex.save` lays it out.
- `CommitHook`: `tenplex.transformer.commit.client` wrapped so the committer can "die" after k of its
  per-store commits, and so the commits that happened are recorded (the model's ground truth).
- `Slot`/`Pool`: store daemons on fixed ports, killed, restarted empty on the same port, their port
  squatted by a listener that answers garbage or nothing, flooded with idle connections, read slowly.
- `Model`: plain Python: which saves exist, where each is committed, which stores are alive and in which
  incarnation; from it, which load outcomes are allowed.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tenplex.store import start_store
from tenplex.store.process import StoreProcess
from tenplex.store.transport import default_token
from tenplex.transformer import world

commit_mod = importlib.import_module("tenplex.transformer.commit")

# ---------------------------------------------------------------------------------------- emulated ranks


class ThreadGroup:
    """`n` ranks of one job, each a thread of this process; `all_gather` meets at a barrier."""

    def __init__(self, n: int, timeout: float = 60.0) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=timeout)
        self.slots: list[Any] = [None] * n


@dataclass(frozen=True)
class RankHandle:
    """What a rank passes as `process_group=`."""

    group: ThreadGroup
    rank: int


_real = {
    k: getattr(world, k)
    for k in ("active", "rank", "size", "all_gather", "decide", "gather_then", "broadcast")
}


def _rank(group: Any = None) -> int:
    return group.rank if isinstance(group, RankHandle) else _real["rank"](group)


def _size(group: Any = None) -> int:
    return group.group.n if isinstance(group, RankHandle) else _real["size"](group)


def _all_gather(obj: Any, group: Any = None, **slot: int) -> list[Any]:
    if not isinstance(group, RankHandle):
        return _real["all_gather"](obj, group, **slot)
    g = group.group
    g.slots[group.rank] = obj
    g.barrier.wait()
    out = list(g.slots)
    g.barrier.wait()
    return out


def _decide(fn: Any, group: Any = None) -> Any:
    if not isinstance(group, RankHandle):
        return _real["decide"](fn, group)
    outcome: tuple[bool, Any] = (True, None)
    if group.rank == 0:
        try:
            outcome = (True, fn())
        except Exception as e:
            outcome = (False, e)
    ok, value = _all_gather(outcome, group)[0]
    if not ok:
        raise value
    return value


def _gather_then(obj: Any, fn: Any, group: Any = None, **slot: int) -> Any:
    if not isinstance(group, RankHandle):
        return _real["gather_then"](obj, fn, group, **slot)
    every = _all_gather(obj, group)
    return _decide(lambda: fn(every), group)


def _broadcast(obj: Any, group: Any = None, **slot: int) -> Any:
    if not isinstance(group, RankHandle):
        return _real["broadcast"](obj, group, **slot)
    return _all_gather(obj, group)[0]


def run_ranks(fns: list[Any], group: ThreadGroup) -> list[BaseException | None]:
    """Run one callable per rank, each in a thread; each rank's exception (None where it returned). A
    rank that raises breaks the group's barrier, so the others do not wait for it (they raise
    `threading.BrokenBarrierError`, which stands for "my partner died")."""
    errors: list[BaseException | None] = [None] * len(fns)

    def one(r: int) -> None:
        try:
            fns[r]()
        except BaseException as e:  # reported to the caller
            errors[r] = e
            group.barrier.abort()

    threads = [threading.Thread(target=one, args=(r,), name=f"explorer-rank{r}") for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


class CommitterDied(Exception):
    """Injected: the committer (rank 0) dies between its per-store commits. Not a tenplex error."""


class _CommitSpy:
    def __init__(self, inner: Any, url: str, hook: CommitHook) -> None:
        self._inner, self._url, self._hook = inner, url, hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def commit(self, job: str, step: int, manifest: Any, *a: Any, **k: Any) -> Any:
        h = self._hook
        if h.die_after is not None and len(h.commits) >= h.die_after:
            raise CommitterDied(f"the committer died before committing on {self._url}")
        out = self._inner.commit(job, step, manifest, *a, **k)
        h.commits.append((self._url, manifest.get("save_id")))
        return out


class CommitHook:
    """Installed around one save: records each store commit; with `die_after=k`, the (k+1)-th raises."""

    def __init__(self) -> None:
        self.active = False
        self.die_after: int | None = None
        self.commits: list[tuple[str, str | None]] = []
        self._real_client = commit_mod.client

    def client(self, url: str) -> Any:
        c = self._real_client(url)
        return _CommitSpy(c, url, self) if self.active else c

    def arm(self, die_after: int | None) -> None:
        self.active, self.die_after, self.commits = True, die_after, []

    def disarm(self) -> None:
        self.active, self.die_after = False, None


HOOK = CommitHook()


def install() -> None:
    """Patch `world` (dispatching on `RankHandle` only) and the save's client (spying only when armed)."""
    world.rank, world.size, world.all_gather, world.decide = _rank, _size, _all_gather, _decide
    world.gather_then, world.broadcast = _gather_then, _broadcast
    commit_mod.client = HOOK.client


# ---------------------------------------------------------------------------------------- live stores


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Squatter:
    """A plain listener on a dead store's port: answers `garbage`, or closes (`close`), or reads and says
    nothing for a moment (`mute`). Records whether the store token ever reached it."""

    def __init__(self, port: int, mode: str) -> None:
        self.mode = mode
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.received = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"squatter-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            try:
                conn.settimeout(0.3)
                if self.mode != "close":
                    try:
                        data = conn.recv(65536)
                        self.received += data[:4096]
                    except OSError:
                        pass
                if self.mode == "garbage":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n{garbage" + os.urandom(16))
                elif self.mode == "mute":
                    time.sleep(0.3)
            except OSError:
                pass
            finally:
                conn.close()

    def token_seen(self, token: str | None) -> bool:
        return bool(token) and token.encode() in bytes(self.received)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@dataclass
class Slot:
    """One store's place: its port, and what is on it now (a daemon, a squatter, or nothing)."""

    index: int
    port: int
    proc: StoreProcess | None = None
    squatter: Squatter | None = None
    held: list[socket.socket] = field(default_factory=list)  # idle/slow connections kept open
    shm_dirs: list[str] = field(default_factory=list)  # of every daemon started here

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Pool:
    """`n` store slots on fixed ports (`--peers` names all of them, `--advertise` each its own)."""

    def __init__(self, n: int = 3, memory_limit: str = "64MiB") -> None:
        self.memory_limit = memory_limit
        self.slots = [Slot(i, p) for i, p in enumerate(free_ports(n))]
        self.replicas = 0
        self.token = default_token()
        self.token_leaks: list[str] = []

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.slots]

    def start(self, i: int) -> None:
        s = self.slots[i]
        assert s.proc is None and s.squatter is None
        deadline = time.monotonic() + 20
        while True:
            try:
                s.proc = start_store(port=s.port, memory_limit=self.memory_limit, peers=self.urls,
                                     replicas=self.replicas, extra=["--advertise", s.url])  # fmt: skip
                break
            except Exception:  # the port in TIME_WAIT or briefly held: try again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        s.shm_dirs.append(s.proc.shm_dir)
        if self.token is None:
            self.token = default_token()

    def kill(self, i: int) -> None:
        s = self.slots[i]
        assert s.proc is not None
        s.proc.kill()
        if s.proc.proc.stdout:
            s.proc.proc.stdout.close()
        s.proc = None
        self.release(i)

    def squat(self, i: int, mode: str) -> None:
        s = self.slots[i]
        assert s.proc is None and s.squatter is None
        s.squatter = Squatter(s.port, mode)

    def unsquat(self, i: int) -> None:
        s = self.slots[i]
        assert s.squatter is not None
        if s.squatter.token_seen(self.token):
            self.token_leaks.append(s.url)
        s.squatter.close()
        s.squatter = None

    def flood(self, i: int, n: int) -> int:
        s, opened = self.slots[i], 0
        for _ in range(n):
            try:
                c = socket.create_connection(("127.0.0.1", s.port), timeout=2)
            except OSError:
                break
            s.held.append(c)
            opened += 1
        return opened

    def slow_reader(self, i: int) -> None:
        """A client that sends half a request head and then nothing (it stays open until released)."""
        s = self.slots[i]
        c = socket.create_connection(("127.0.0.1", s.port), timeout=2)
        c.sendall(b"GET /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthor")
        s.held.append(c)

    def release(self, i: int) -> None:
        s = self.slots[i]
        for c in s.held:
            c.close()
        s.held.clear()

    def set_replicas(self, replicas: int) -> None:
        self.replicas = replicas
        for s in self.slots:
            if s.proc is not None:
                s.proc.client().set_peers(self.urls, replicas)

    def check_token(self) -> list[str]:
        """Slots whose squatter has seen the store token so far (checked while squatting, too)."""
        return [s.url for s in self.slots if s.squatter is not None and s.squatter.token_seen(self.token)]

    def reset(self, jobs: list[str]) -> None:
        """Every slot a live daemon again, no squatter, no held connection, the given jobs deleted."""
        for s in self.slots:
            self.release(s.index)
            if s.squatter is not None:
                self.unsquat(s.index)
            if s.proc is not None and s.proc.proc.poll() is not None:
                s.proc = None
            if s.proc is None:
                self.start(s.index)
            else:
                c = s.proc.client()
                for job in jobs:
                    try:
                        c.delete_job(job)
                    except Exception:
                        pass

    def close(self) -> list[str]:
        """Stop everything; what was left behind (must be empty)."""
        left = []
        for s in self.slots:
            self.release(s.index)
            if s.squatter is not None:
                s.squatter.close()
                s.squatter = None
            if s.proc is not None:
                if s.proc.stop() != 0:
                    left.append(f"store {s.url} did not exit cleanly")
                s.proc = None
            for d in s.shm_dirs:
                if os.path.exists(d):
                    left.append(d)
                    shutil.rmtree(d, ignore_errors=True)
        return left


# ---------------------------------------------------------------------------------------- the model

TENSORS = ("common", "w0", "w1")


def state_of(serial: int, rank: int, nranks: int) -> dict[str, Any]:
    """Rank `rank`'s part of save `serial`: recognisable values (the serial in every element)."""
    base = np.float64(serial)
    common = np.full((64,), base, dtype=np.float64) + np.arange(64) * 1e-6
    w0 = np.full((16, 16), serial, dtype=np.float32) + np.arange(256, dtype=np.float32).reshape(16, 16) / 1e3
    w1 = np.full((8, 8), serial * 1000, dtype=np.int64) + np.arange(64).reshape(8, 8)
    full = {"common": common, "w0": w0, "w1": w1}
    if nranks == 1:
        mine = full
    else:  # rank r holds w{r}; every rank holds common (the save writes one copy per store)
        mine = {"common": common, f"w{rank}": full[f"w{rank}"]}
    return mine


def full_state(serial: int) -> dict[str, np.ndarray]:
    return state_of(serial, 0, 1)


@dataclass
class Save:
    serial: int
    step: int
    slots: tuple[int, ...]
    incs: dict[int, int]
    committed: set[int] = field(default_factory=set)
    keep: int | None = None
    torn: bool = False
    save_id: str | None = None

    @property
    def complete(self) -> bool:
        return self.committed == set(self.slots)


@dataclass
class Model:
    """Plain Python: the saves, where each is committed, the stores' liveness and incarnations."""

    n: int
    alive: list[bool] = field(default_factory=list)
    squatted: list[bool] = field(default_factory=list)
    inc: list[int] = field(default_factory=list)
    held: list[dict[int, int]] = field(default_factory=list)  # slot -> step -> serial committed there
    saves: list[Save] = field(default_factory=list)
    lost_by_fault: bool = False  # a complete save was lost with a store (killed, restarted empty)
    store_faults: bool = False  # a store was killed / restarted / squatted in this sequence
    next_step: int = 1

    def __post_init__(self) -> None:
        self.alive = [True] * self.n
        self.squatted = [False] * self.n
        self.inc = [0] * self.n
        self.held = [{} for _ in range(self.n)]

    def healthy(self, i: int) -> bool:
        return self.alive[i] and not self.squatted[i]

    def survives(self, s: Save) -> bool:
        return s.complete and all(
            self.healthy(x) and self.inc[x] == s.incs[x] and self.held[x].get(s.step) == s.serial
            for x in s.slots
        )

    def floor(self) -> Save | None:
        """The newest complete save that survives on the live stores (the one a load must not go below)."""
        alive = [s for s in self.saves if self.survives(s)]
        return max(alive, key=lambda s: s.step) if alive else None

    def complete_at(self, step: int) -> list[Save]:
        return [s for s in self.saves if s.step == step and s.complete]

    def kill(self, i: int) -> None:
        if any(s.complete and s.incs.get(i) == self.inc[i] and self.held[i].get(s.step) == s.serial
               for s in self.saves):  # fmt: skip
            self.lost_by_fault = True
        self.alive[i] = False
        self.held[i] = {}
        self.store_faults = True

    def restart(self, i: int) -> None:
        self.alive[i] = True
        self.inc[i] += 1
        self.held[i] = {}
        self.store_faults = True
