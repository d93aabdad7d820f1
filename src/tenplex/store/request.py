"""What a handler sees of a request (`Request`: params, query, headers, its body read on demand, the
connection's leases) and the route table the server dispatches on and the OpenAPI document is built from.
"""

from __future__ import annotations

import itertools
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import unquote

import numpy as np

from .auth import Challenge
from .errors import BadRequestError, TooLargeError
from .keys import check_job, check_name, check_step
from .protocol import MAX_JSON, Conn, parse_json


@dataclass(eq=False)
class Session:
    """One connection's standing: where it came from and whether it proved it holds the token (a Unix
    socket peer the kernel vouched for, or a TCP client that passed the handshake, see `auth`)."""

    sock: socket.socket
    peer: str
    authed: bool
    since: float = field(default_factory=time.monotonic)
    challenge: Challenge | None = None  # what its `/v1/hello` asked, until `/v1/auth` checks it
    pool: str = ""  # "auth" or "unauth" while the server counts it there, "" once it is not counted


@dataclass
class Request:
    conn: Conn
    method: str
    params: dict[str, str]
    query: dict[str, list[str]]
    headers: dict[str, str]
    length: int
    consumed: bool = False  # the body has been read completely
    scratch: list[np.ndarray] = field(default_factory=list)  # the connection's reusable buffer
    leases: dict[int, list[Any]] = field(default_factory=dict)  # what the connection holds, by lease id
    session: Session | None = None  # the connection's standing (None only outside a server)

    @property
    def trusted(self) -> bool:
        """Whether the connection it came on is authenticated."""
        return self.session is not None and self.session.authed

    def lease(self, items: list[Any]) -> int:
        """Keep `items` held for this connection until `unlease` (or `Server.end_leases` at its close)."""
        n = next(_lease_ids)
        self.leases[n] = items
        return n

    def unlease(self, n: int) -> list[Any]:
        """The items of lease `n` of this connection, no longer leased ([] for an unknown lease)."""
        return self.leases.pop(n, [])

    def json(self) -> dict[str, Any]:
        if self.length > MAX_JSON:
            raise TooLargeError(f"JSON body of {self.length} bytes exceeds {MAX_JSON}")
        raw = self.conn.read_bytes(self.length) if self.length else b"{}"
        self.consumed = True
        body = parse_json(raw)
        if not isinstance(body, dict):
            raise BadRequestError("the JSON body must be an object")
        return body

    def job(self) -> str:
        return check_job(self.params["job"])

    def step(self) -> int:
        return check_step(self.params["step"])

    def name(self) -> str:
        try:
            return check_name(unquote(self.params["name"], errors="strict"))
        except UnicodeDecodeError:
            raise BadRequestError("blob name is not UTF-8") from None


# process-wide: a lease id is never reused, so a stale one names no other lease
_lease_ids = itertools.count(1)
Handler = Callable[[Any, Request], Any]


class Route(NamedTuple):
    method: str
    pattern: re.Pattern[str]
    handler: Handler
    body: str  # "none", "json" or "raw"
    public: bool  # answered on a connection not authenticated (the handshake and `/v1/local`)


class RouteTable(list[Route]):
    """The routes; `route` is the decorator that adds one (body kind from the method unless given)."""

    def route(
        self, method: str, pattern: str, body: str | None = None, public: bool = False
    ) -> Callable[[Handler], Handler]:
        kind = body or {"PUT": "raw", "POST": "json"}.get(method, "none")

        def deco(fn: Handler) -> Handler:
            self.append(Route(method, re.compile(pattern + "$"), fn, kind, public))
            return fn

        return deco
