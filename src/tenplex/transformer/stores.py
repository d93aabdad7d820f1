"""Which store a rank talks to, and one client per store URL per process."""

from __future__ import annotations

import threading

from ..store import StoreClient
from ..store.client import DEFAULT_URL
from ..util import env


class Clients:
    """One client per store URL per process: process-wide on purpose, since a client keeps its
    connections and shared-memory maps open for the next call."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, bool | None], StoreClient] = {}
        self._lock = threading.Lock()

    def get(self, url: str, local: bool | None) -> StoreClient:
        with self._lock:
            c = self._by_key.get((url, local))
            if c is None:
                c = self._by_key[(url, local)] = StoreClient(url, local=local)
            return c

    def clear(self) -> None:
        """Forget every client: the next call of `client` makes a new one."""
        with self._lock:
            self._by_key.clear()


CLIENTS = Clients()


def resolve(store: str | None) -> str:
    """The `store=` argument, else TENPLEX_STORE, else the store on this host at the default port."""
    return (store or env.get(env.STORE) or DEFAULT_URL).rstrip("/")


def client(url: str) -> StoreClient:
    """Stores of emulated hosts (TENPLEX_EMULATED_HOSTS=1) are reached over the network even when they run
    on this machine, so that traffic between emulated hosts takes the network path; the own store still
    uses shared memory."""
    own = url == resolve(None)
    return CLIENTS.get(url, None if own or not env.flag(env.EMULATED_HOSTS) else False)
