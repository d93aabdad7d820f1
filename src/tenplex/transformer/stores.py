"""Which store a rank talks to, and one client per store URL per process."""

from __future__ import annotations

import os
import threading

from ..store import StoreClient
from ..store.client import DEFAULT_URL

_clients: dict[tuple[str, bool | None], StoreClient] = {}
_lock = threading.Lock()


def resolve(store: str | None) -> str:
    """The `store=` argument, else TENPLEX_STORE, else the store on this host at the default port."""
    return (store or os.environ.get("TENPLEX_STORE") or DEFAULT_URL).rstrip("/")


def client(url: str) -> StoreClient:
    """Stores of emulated hosts (TENPLEX_EMULATED_HOSTS=1) are reached over the network even when they run
    on this machine, so that traffic between emulated hosts takes the network path; the own store still
    uses shared memory."""
    own = url == resolve(None)
    local = None if own or os.environ.get("TENPLEX_EMULATED_HOSTS") != "1" else False
    key = (url, local)
    with _lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = StoreClient(url, local=local)
        return c
