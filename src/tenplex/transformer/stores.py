"""Which store a rank talks to, and one client per store URL per process."""

from __future__ import annotations

import threading

from ..store import StoreClient
from ..store.client import DEFAULT_URL
from ..util import env

_clients: dict[tuple[str, bool | None], StoreClient] = {}
_lock = threading.Lock()


def resolve(store: str | None) -> str:
    """The `store=` argument, else TENPLEX_STORE, else the store on this host at the default port."""
    return (store or env.get(env.STORE) or DEFAULT_URL).rstrip("/")


def client(url: str) -> StoreClient:
    """Stores of emulated hosts (TENPLEX_EMULATED_HOSTS=1) are reached over the network even when they run
    on this machine, so that traffic between emulated hosts takes the network path; the own store still
    uses shared memory."""
    own = url == resolve(None)
    local = None if own or not env.flag(env.EMULATED_HOSTS) else False
    key = (url, local)
    with _lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = StoreClient(url, local=local)
        return c
