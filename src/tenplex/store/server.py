"""The store's HTTP/1.1 server on raw sockets: the accept loop, one thread per connection, request heads
parsed and checked, routed through a route table, errors answered as JSON.

It knows nothing of blobs or versions: `Daemon` (the store's state) subclasses it and the handlers in
`routes` receive the daemon and a `Request`.
"""

from __future__ import annotations

import hmac
import itertools
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np

from ..util import logs
from .errors import AuthError, BadRequestError, NotFoundError, StoreError
from .keys import check_job, check_name, check_step
from .protocol import REASONS, Closed, Conn, content_length, json_body

MAX_CONNECTIONS = 1024
IDLE_TIMEOUT = 300.0  # seconds a connection may stay silent (also bounds a stalled body)

log = logs.get("store")


@dataclass
class Request:
    conn: Conn
    method: str
    params: dict[str, str]
    query: dict[str, list[str]]
    headers: dict[str, str]
    length: int
    consumed: bool = False
    scratch: list[np.ndarray] = field(default_factory=list)  # the connection's reusable buffer
    leases: dict[int, list[Any]] = field(default_factory=dict)  # what the connection holds, by lease id

    def lease(self, items: list[Any]) -> int:
        """Keep `items` held for this connection until `unlease` (or `Server.end_leases` at its close)."""
        n = next(_lease_ids)
        self.leases[n] = items
        return n

    def unlease(self, n: int) -> list[Any]:
        """The items of lease `n` of this connection, no longer leased ([] for an unknown lease)."""
        return self.leases.pop(n, [])

    def json(self) -> dict[str, Any]:
        self.consumed = True
        body = self.conn.read_json(self.length) if self.length else {}
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


_lease_ids = itertools.count(1)
Handler = Callable[[Any, Request], Any]
Route = tuple[str, re.Pattern[str], Handler]


class RouteTable(list[Route]):
    """(method, path pattern, handler) rows; `route` is the decorator that adds one."""

    def route(self, method: str, pattern: str) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.append((method, re.compile(pattern + "$"), fn))
            return fn

        return deco


class Server:
    """Serves `routes` on `host:port`; every request must carry `token` when one is set."""

    def __init__(self, host: str, port: int, token: str | None, routes: list[Route]) -> None:
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=512)
        self.port = self.sock.getsockname()[1]
        self.token = token
        self.routes = routes
        self.counters = {"requests": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0}
        self.conns: set[socket.socket] = set()
        self._lock = threading.Lock()

    def serve_forever(self) -> None:
        while True:
            client, _ = self.sock.accept()
            with self._lock:
                full = len(self.conns) >= MAX_CONNECTIONS
                if not full:
                    self.conns.add(client)
            if full:
                _reject(client)
                continue
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def close(self) -> None:
        """Stop accepting and shut every open connection."""
        self.sock.close()
        with self._lock:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def connection_stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "connections": len(self.conns)}

    def end_leases(self, leases: dict[int, list[Any]]) -> None:
        """A connection closed with `leases` still held (a reader that died): the store releases them."""

    def _connection(self, sock: socket.socket) -> None:
        sock.settimeout(IDLE_TIMEOUT)
        conn = Conn(sock)
        scratch: list[np.ndarray] = []
        leases: dict[int, list[Any]] = {}
        try:
            while self._one(conn, scratch, leases):
                pass
        except (OSError, Closed):
            pass
        finally:
            with self._lock:
                self.conns.discard(sock)
            conn.close()
            if leases:
                self.end_leases(leases)

    def _one(self, conn: Conn, scratch: list[np.ndarray], leases: dict[int, list[Any]]) -> bool:
        """Serve one request; False when the connection must close."""
        try:
            start, headers = conn.read_head()
        except Closed:
            return False
        except StoreError as e:  # unparseable head: framing is lost, answer and close
            self.count("errors")
            send_error(conn, e, close=True)
            return False
        self.count("requests")
        req: Request | None = None
        try:
            req = self._parse(conn, start, headers, scratch)
            req.leases = leases
            handler = self._find(req, start)
            result = handler(self, req)
            if result is not None:
                if not req.consumed and req.length:
                    raise BadRequestError("this request takes no body")
                body = json_body(result)
                conn.send_head("HTTP/1.1 200 OK", headers_for(len(body)), body)
        except StoreError as e:
            self.count("errors")
            # the body may still be on the wire: skip a small one, otherwise close after answering
            close = req is None or (not req.consumed and req.length > (1 << 20))
            if req is not None and not req.consumed and not close:
                try:
                    conn.drain(req.length)
                except StoreError:
                    close = True
            if req is not None and req.consumed and getattr(e, "mid_body", False):
                close = True
            send_error(conn, e, close=close)
            return not close
        except (OSError, Closed):
            raise
        except Exception as e:  # a bug must not take the daemon down: report it and drop the connection
            self.count("errors")
            log.exception("internal error serving %r", start[:200])
            send_error(conn, StoreError(f"internal error: {type(e).__name__}: {e}"), close=True)
            return False
        return headers.get("connection", "").lower() != "close"

    def _parse(self, conn: Conn, start: str, headers: dict[str, str], scratch: list[np.ndarray]) -> Request:
        parts = start.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequestError(f"malformed request line {start[:80]!r}")
        length = content_length(headers)
        if self.token is not None:  # checked before anything else; the connection is closed on failure
            auth = headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.token}".encode()):
                raise AuthError("missing or wrong bearer token")
        split = urlsplit(parts[1])
        return Request(
            conn, parts[0], {"_path": split.path}, parse_qs(split.query), headers, length, False, scratch
        )

    def _find(self, req: Request, start: str) -> Handler:
        path = req.params.pop("_path")
        allowed = False
        for method, pattern, fn in self.routes:
            m = pattern.match(path)
            if m:
                allowed = True
                if method == req.method:
                    req.params.update(m.groupdict())
                    return fn
        if allowed:
            raise BadRequestError(f"method {req.method} not allowed on {path[:200]}")
        raise NotFoundError(f"no such endpoint: {start[:200]}")


def headers_for(length: int, ctype: str = "application/json") -> dict[str, str]:
    return {"Content-Type": ctype, "Content-Length": str(length)}


def send_error(conn: Conn, e: StoreError, close: bool) -> None:
    body = json_body({"error": e.kind, "message": str(e)})
    headers = headers_for(len(body))
    if close:
        headers["Connection"] = "close"
    try:
        conn.send_head(f"HTTP/1.1 {e.status} {REASONS.get(e.status, 'Error')}", headers, body)
    except OSError:
        pass


def _reject(sock: socket.socket) -> None:
    try:
        send_error(Conn(sock), StoreError("too many connections"), close=True)
    finally:
        sock.close()
