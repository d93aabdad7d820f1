"""The runtime's signals to its ranks through a TCPStore, torch's own tool for this (set, wait, compare_set).

`tenplex run`'s controller hosts one (`Channel`, on its own address: loopback, or its namespace's on
namespace hosts); a `tenplex agent` hosts one for its workers. Keys are per phase (a round under an agent):

- `stop/N`: stop at the next step boundary and save, or at a given step (`stop_word`);
- `broken/N`: the phase broke (a host lost, a rank failed): a rank that waits on the others (a commit under
  way) leaves the phase instead;
- `turn/N`: a phase started ahead goes ("go TIME") or never runs ("cancel"): the first word wins
  (`compare_set`), so the ranks, the controller and the old phase's rank 0 all read the same answer;
- `next/N`: the phase started ahead after phase N, whose turn N's rank 0 gives once its final save committed;
- `fired/N/STEP`: the failure the schedule injects at STEP hit; the ranks waiting there go on;
- `ended/ID`, `exit/ID`: a standby process's role ended well (it waits for the next), a spare the zygote
  forked ended, with their exit codes (`tell`: written before the zygote reaps it, so a spare seen gone has
  its code).

Ranks wait on a key (`TCPStore.wait`) instead of polling a file, and a rank whose runtime is gone finds
out at its next look (the connection breaks) instead of waiting forever.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from ..ptc import TenplexError

CONNECT_S = 60.0  # a rank waits this long for its runtime's store to answer (it may start after the rank)
LONG_S = 7 * 24 * 3600.0  # a rank started ahead may wait a whole phase for its turn
TELL_S = 10.0  # an exit code that cannot be told this long after: the runtime is gone


class ChannelError(TenplexError):
    """The runtime's store cannot be reached: the runtime is gone, or never started its channel."""


def _connect(address: str, timeout: float) -> Any:
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:
        raise ChannelError(f"the runtime's store at {address} does not answer: {_said(e)}") from None


def _said(e: BaseException) -> str:
    """torch's error, its first line (the rest is a C++ stack)."""
    return str(e).strip().split("\n", 1)[0]


def _went(value: bytes | str) -> tuple[bool, float]:
    """(went, when) from a `turn` value: "go TIME" or "cancel"."""
    text = value.decode() if isinstance(value, bytes) else value
    word, _, when = text.partition(" ")
    return word == "go", float(when or 0.0)


def put(store: Any, key: str, value: str) -> None:
    """`TCPStore.set`, returned only once the store applied it. Why: torch's `set` sends and returns
    without an answer, so a reader on another connection could still miss the key (reads right after a
    set often did on a loaded machine); an answered request on the same connection is served after it."""
    store.set(key, value)
    store.check([key])


def stop_word(why: str, at: int | None) -> str:
    """A stop's value: its reason, and the step it waits for (None: the next step boundary)."""
    return why if at is None else json.dumps({"why": why, "at": at})


def stop_due(value: bytes | str, step: int | None) -> bool:
    """Whether a stop said as `value` (`stop_word`) ends the phase after step `step` (None: at once). A
    step already past the asked one stops at once: the change is late, not lost."""
    text = value.decode() if isinstance(value, bytes) else value
    if step is None or not text.startswith("{"):
        return True
    return step >= int(json.loads(text)["at"])


def tell(address: str, key: str, code: int, tries: int = 3) -> None:
    """One exit code into the runtime's store, over a connection of its own that ends with the call: a
    standby process or the zygote, which forks, never holds one across a fork. A connection that breaks
    is made again: a code never told reads as a kill (many spares ending at once on a loaded machine lost
    one now and then)."""
    for attempt in range(tries):
        try:
            store = _connect(address, TELL_S)
            try:
                put(store, key, str(code))
                return
            finally:
                del store
        except (ChannelError, RuntimeError) as e:
            if attempt == tries - 1:
                raise ChannelError(f"could not tell {key} to {address}: {_said(e)}") from None
            time.sleep(0.05)


class Channel:
    """The controller's end: it hosts the store. Made at once (the address goes into the ranks' spec);
    the store itself starts in `serve`, on the thread that imports torch, and every call waits for it.

    The port is bound and listening from the start and handed to the store (`master_listen_fd`): a port
    only found free and bound seconds later, once torch is imported, was now and then taken in between by
    another process's connection (EADDRINUSE), and ranks that connect early wait in the backlog."""

    def __init__(self, host: str) -> None:
        self._socket: socket.socket | None = socket.create_server((host, 0), backlog=128)
        self.address = f"{host}:{self._socket.getsockname()[1]}"
        self._store: Any = None
        self._error: str | None = None
        self._served = threading.Event()

    def serve(self) -> None:
        import torch.distributed as dist

        host, _, port = self.address.rpartition(":")
        sock, self._socket = self._socket, None
        assert sock is not None, "a channel serves once"
        try:
            self._store = dist.TCPStore(
                host,
                int(port),
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=CONNECT_S),
                master_listen_fd=sock.fileno(),
            )
            sock.detach()  # the store owns the descriptor now and closes it with itself
        except (RuntimeError, ValueError) as e:
            self._error = f"the runtime's store could not start at {self.address}: {_said(e)}"
        finally:
            if sock.fileno() >= 0:  # the store did not take it
                sock.close()
            self._served.set()

    def close(self) -> None:
        """The store's server thread ends here, not in the interpreter's teardown: a store kept alive by a
        traceback to the end aborted the process there ("terminate called without an active exception")."""
        if self._served.wait(CONNECT_S):
            self._store, self._error = None, f"the runtime's store at {self.address} is closed"

    @property
    def store(self) -> Any:
        self._served.wait()
        if self._store is None:
            raise ChannelError(self._error or f"the runtime's store at {self.address} did not start")
        return self._store

    def stop(self, phase: int) -> None:
        put(self.store, f"stop/{phase}", "1")

    def fire(self, phase: int, step: int) -> None:
        put(self.store, f"fired/{phase}/{step}", "1")

    def name_next(self, phase: int, after: int) -> None:
        """Phase `phase` was started ahead after phase `after`: `after`'s rank 0 gives it its turn."""
        put(self.store, f"next/{after}", str(phase))

    def go(self, phase: int) -> bool:
        """Give phase `phase` its turn unless it was cancelled; whether it goes."""
        return _went(self.store.compare_set(f"turn/{phase}", "", f"go {time.time()}"))[0]

    def cancel(self, phase: int) -> bool:
        """Cancel phase `phase` unless it was told to go already; whether it is cancelled."""
        return not _went(self.store.compare_set(f"turn/{phase}", "", "cancel"))[0]

    def code(self, key: str) -> int | None:
        """The exit code told under `key` (`tell`), None while there is none."""
        return int(self.store.get(key)) if self.store.check([key]) else None

    def went(self, phase: int) -> bool:
        """Whether phase `phase` was told to go."""
        key = f"turn/{phase}"
        return bool(self.store.check([key])) and _went(self.store.get(key))[0]


class RankChannel:
    """A rank's end: its phase's keys in its runtime's store, connected on first use (after any fork)."""

    def __init__(self, address: str, phase: int, store: Any = None) -> None:
        self.address, self.phase, self._store = address, phase, store
        self._checked = 0.0  # when the last step's stop check was (a step's time, for `stop_asked`)

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = _connect(self.address, CONNECT_S)
        return self._store

    def _ask(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:  # the connection broke: the runtime is gone
            raise ChannelError(f"lost the runtime's store at {self.address}: {_said(e)}") from None

    def stop_asked(self, step: int | None = None) -> bool:
        """Whether to stop after step `step` (None: whether a stop was said at all). While a stop waits for
        a later step, how long the steps up to it will take at this pace is said back (`reached/N`, in
        seconds: an agent forms the next round while the last ones train)."""
        key, now = f"stop/{self.phase}", time.monotonic()
        since, self._checked = now - self._checked, now
        if not self._ask(self.store.check, [key]):
            return False
        word = self._ask(self.store.get, key)
        due = stop_due(word, step)
        if not due and step is not None:
            left = (int(json.loads(word)["at"]) - step) * since
            self._ask(self.store.set, f"reached/{self.phase}", str(left))
        return due

    def broken(self) -> bool:
        """Whether the runtime found this phase broken (a host lost, a rank failed): nothing waiting on
        the others' collectives will end."""
        return bool(self._ask(self.store.check, [f"broken/{self.phase}"]))

    def wait_turn(self) -> tuple[bool, float]:
        """Wait until this phase is told to go or cancelled: (goes, when it was told)."""
        key = f"turn/{self.phase}"
        self._ask(self.store.wait, [key], timedelta(seconds=LONG_S))
        return _went(self._ask(self.store.get, key))

    def await_fired(self, step: int, timeout: float) -> None:
        """Wait where the schedule injects a failure until the runtime fired it."""
        try:
            self.store.wait([f"fired/{self.phase}/{step}"], timedelta(seconds=timeout))
        except RuntimeError as e:
            raise ChannelError(f"the failure due at step {step} was never injected: {_said(e)}") from None

    def hand_over(self) -> None:
        """This phase's final save committed: the phase started ahead after it (if one was named) goes."""
        key = f"next/{self.phase}"
        if self._ask(self.store.check, [key]):
            after = self._ask(self.store.get, key).decode()
            self._ask(self.store.compare_set, f"turn/{after}", "", f"go {time.time()}")
