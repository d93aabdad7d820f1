"""The store's HTTP/1.1 server on raw sockets: the accept loop, one thread per connection, request heads
parsed by llhttp (`heads`), authenticated, checked against their route, errors answered as JSON.

Two ways in: TCP, where a connection proves it holds the token with the handshake of `auth` (`/v1/hello`,
then `/v1/auth`) before anything but those two and `GET /v1/local` is answered, and (`listen_unix`) a Unix
domain socket, mode 0600, for this host's processes: a connection on it is authenticated by the kernel's
SO_PEERCRED (the peer must be the daemon's uid or root; others are answered 401 and closed).

It knows nothing of blobs or versions: `Daemon` (the store's state) subclasses it and the handlers in
`routes` receive the daemon and a `Request`.

Hostile or excessive input: the soft open-file limit is raised to the hard one at start. Connections not
authenticated yet have a small budget of their own (in all and per peer address; a newcomer past it
displaces the oldest one of the address that holds the most) and AUTH_TIMEOUT seconds to prove themselves,
so a flood of them never takes the room of authenticated ones, which have their own caps, well below the
open-file limit. An accept that fails for lack of file descriptors sheds the waiting connection and backs
off instead of ending the daemon; a request head must arrive within HEAD_TIMEOUT seconds; every framing
doubt (bad head, body on a route that takes none, a body over the limit, an error before the body was
read, `Connection: close`) closes the connection after the answer, so no body is ever parsed as a request.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import threading
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np

from ..util import logs
from .admission import Admission
from .errors import AuthError, BadRequestError, NotFoundError, StoreError, StoreUnavailable, TooLargeError
from .heads import Head, parse_head
from .protocol import MAX_JSON, REASONS, Closed, Conn, json_body, peer_uid, trusted_uid
from .request import Request, Route, Session

MAX_CONNECTIONS = 4096  # authenticated connections at most (also at most a quarter of the open-file limit)
MAX_UNAUTH = 64  # connections not authenticated yet, in all
MAX_UNAUTH_PER_PEER = 16  # ... and from one address
AUTH_TIMEOUT = 5.0  # seconds a connection has to authenticate, from its accept
HEAD_TIMEOUT = 5.0  # seconds for a request head, from a new connection or from its first byte
IDLE_TIMEOUT = 300.0  # seconds a keep-alive connection may wait between requests
BODY_TIMEOUT = 60.0  # seconds a body may stall
PUBLIC_BODY = 4096  # bytes of body a route answered without authentication accepts
LINGER = 2.0  # seconds to discard a body still arriving after an early answer (authenticated: 30 s, so
LINGER_TRUSTED = 30.0  # that a big write into a full store over a slow link still reads its 507)
UNPROVEN = "authenticate first: POST /v1/hello, then POST /v1/auth (see tenplex.store.auth)"
_SHORT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

log = logs.get("store")


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 16


class Server:
    """Serves `routes` on `host:port`; with a `token`, only connections that proved they hold it get
    more than the public routes."""

    def __init__(self, host: str, port: int, token: str | None, routes: list[Route]) -> None:
        fds = raise_fd_limit()
        self.max_connections = max(8, min(MAX_CONNECTIONS, fds // 4))
        self.admission = Admission(self.max_connections, MAX_UNAUTH, MAX_UNAUTH_PER_PEER)
        self.sock = socket.create_server((host, port), reuse_port=False, backlog=512)
        self.port = self.sock.getsockname()[1]
        self.token = token
        self.routes = routes
        self.counters = {
            "requests": 0,
            "accepted": 0,  # connections
            "errors": 0,
            "bytes_in": 0,
            "bytes_out": 0,
            "refused": 0,
            "fd_exhausted": 0,
            "displaced": 0,  # unauthenticated connections closed to make room for newer ones
        }
        self.conns: set[socket.socket] = set()  # every open connection, to shut at close
        self._lock = threading.Lock()
        self._spare = os.open(os.devnull, os.O_RDONLY)  # given up to shed a connection when out of fds
        self.unix_sock: socket.socket | None = None
        self.unix_path = ""  # the Unix socket's path ("" when there is none)

    def listen_unix(self, path: str) -> None:
        """Also serve this host's processes on a Unix socket at `path` (mode 0600, a stale one replaced),
        authenticated by SO_PEERCRED instead of the token; accepted in a thread of its own."""
        if os.path.lexists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # never reachable by others, not even between bind and chmod
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(512)
        self.unix_sock, self.unix_path = sock, path
        threading.Thread(target=self._accept_unix, args=(sock,), daemon=True).start()

    def _accept_unix(self, sock: socket.socket) -> None:
        try:
            self._accept_loop(sock, unix=True)
        except OSError:  # the socket was closed: the daemon is stopping
            pass

    def serve_forever(self) -> None:
        self._accept_loop(self.sock, unix=False)

    def _accept_loop(self, sock: socket.socket, unix: bool) -> None:
        delay = 0.0
        while True:
            try:
                client, addr = sock.accept()
            except OSError as e:
                if e.errno in _SHORT_OF_FDS:
                    self.count("fd_exhausted")
                    log.warning("accept: %s; shedding one connection, backing off %.2f s", e.strerror, delay)
                    self._shed(sock)
                    time.sleep(delay)
                    delay = min(1.0, delay * 2 or 0.01)
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN):
                    continue
                raise
            delay = 0.0
            if unix:
                self._admit_unix(client)
            else:
                self._admit(client, str(addr[0]) if isinstance(addr, tuple) else "")

    def _admit_unix(self, client: socket.socket) -> None:
        """A connection on the Unix socket: admitted as trusted when its peer is this uid or root."""
        try:
            uid = peer_uid(client)
        except OSError:
            client.close()
            return
        if not trusted_uid(uid):
            self.count("refused")
            log.warning("refused a connection on %s from uid %d", self.unix_path, uid)
            _reject(client, "", AuthError(f"uid {uid} may not use this store's socket"))
            return
        self._admit(client, f"uid:{uid}", local=True)

    def _admit(self, client: socket.socket, peer: str, local: bool = False) -> None:
        """Count a new connection in its pool (authenticated when `local` or when there is no token) and
        serve it in a thread of its own; past the caps it is refused (authenticated) or displaces the
        oldest unauthenticated connection of the address holding the most."""
        s = Session(client, peer, authed=local or self.token is None)
        with self._lock:
            victim = self.admission.enter(s)
            if victim is not None:  # an unauthenticated connection closed to make room
                self.counters["displaced"] += 1
            if s.pool:
                self.conns.add(client)
                self.counters["accepted"] += 1
        if victim is not None:
            _shut(victim.sock)
        if not s.pool:
            self.count("refused")
            _reject(client, "too many connections")
            return
        try:
            threading.Thread(target=self._connection, args=(s,), daemon=True).start()
        except RuntimeError:  # no thread to be had: same as no room
            self._forget(s)
            _reject(client, "out of threads")

    def _shed(self, sock: socket.socket) -> None:
        """Out of descriptors: free the spare one, accept the waiting connection and close it at once."""
        try:
            os.close(self._spare)
            sock.settimeout(0)
            try:
                c, _ = sock.accept()
                c.close()
            except OSError:
                pass
            finally:
                sock.settimeout(None)
        except OSError:
            pass
        finally:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                self._spare = -1

    def close(self) -> None:
        """Stop accepting and shut every open connection."""
        self.sock.close()
        if self.unix_sock is not None:
            self.unix_sock.close()
            try:
                os.unlink(self.unix_path)
            except OSError:
                pass
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1
        with self._lock:
            conns = list(self.conns)
        for c in conns:
            _shut(c)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def connection_stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "connections": len(self.conns), "max_connections": self.max_connections,
                    "unauthenticated": self.admission.unauthenticated}  # fmt: skip

    def end_leases(self, leases: dict[int, list[Any]]) -> None:
        """A connection closed with `leases` still held (a reader that died): the store releases them."""

    def promote(self, s: Session) -> None:
        """`s` proved it holds the token: move it to the authenticated pool (StoreUnavailable when that
        is full, or when it was displaced meanwhile)."""
        with self._lock:
            self.admission.promote(s)

    def _forget(self, s: Session) -> None:
        with self._lock:
            self.conns.discard(s.sock)
            self.admission.leave(s)

    def _connection(self, s: Session) -> None:
        conn = Conn(s.sock)
        scratch: list[np.ndarray] = []
        leases: dict[int, list[Any]] = {}
        idle = HEAD_TIMEOUT  # a new connection says something at once, or goes
        try:
            while True:
                if not s.authed:  # proven in time, or closed
                    left = _auth_left(s)
                    if left <= 0:
                        break
                    idle = min(idle, left)
                if not self._one(conn, s, scratch, leases, idle):
                    break
                idle = IDLE_TIMEOUT
        except (OSError, Closed):
            pass
        finally:
            self._forget(s)
            conn.close()
            if leases:
                self.end_leases(leases)

    def _one(
        self, conn: Conn, s: Session, scratch: list[np.ndarray], leases: dict[int, list[Any]], idle: float
    ) -> bool:
        """Serve one request on the connection of `s`; False when the connection must close."""
        limit = HEAD_TIMEOUT if s.authed else max(0.01, min(HEAD_TIMEOUT, _auth_left(s)))
        try:
            raw = conn.read_head_bytes(idle, limit)
        except Closed:
            return False
        except StoreError as e:  # head too large, too slow or cut: framing is lost, answer and close
            self.count("errors")
            send_error(conn, e, close=True)
            return False
        conn.sock.settimeout(BODY_TIMEOUT)
        self.count("requests")
        req: Request | None = None
        head: Head | None = None
        try:
            head = parse_head(raw)
            req, route = self._request(conn, head, scratch, s)
            req.leases = leases
            result = route.handler(self, req)
            if result is not None:
                if not req.consumed and req.length:
                    raise BadRequestError("this request takes no body")
                body = json_body(result)
                headers = headers_for(len(body))
                if not head.keep_alive:
                    headers["Connection"] = "close"
                conn.send_head("HTTP/1.1 200 OK", headers, body)
            return head.keep_alive
        except StoreError as e:
            self.count("errors")
            keep = req is not None and (req.consumed or not req.length) and not isinstance(e, AuthError)
            keep = keep and head is not None and head.keep_alive
            send_error(conn, e, close=not keep)
            if not keep and req is not None and not req.consumed and req.length:
                conn.linger(req.length, LINGER_TRUSTED if req.trusted else LINGER)
            return keep
        except (OSError, Closed):
            raise
        except Exception as e:  # a bug must not take the daemon down: report it and drop the connection
            self.count("errors")
            log.exception("internal error serving %r", raw[:200])
            send_error(conn, StoreError(f"internal error: {type(e).__name__}: {e}"), close=True)
            return False

    def _request(
        self, conn: Conn, head: Head, scratch: list[np.ndarray], s: Session
    ) -> tuple[Request, Route]:
        """The request and its route, refused before any handler runs when its connection is not
        authenticated (401 whatever the path, but for the public routes) or its body is wrong."""
        split = urlsplit(head.target)
        query = parse_qs(split.query)
        req = Request(conn, head.method, {}, query, head.headers, head.length, scratch=scratch, session=s)
        try:
            route: Route | None = self._find(req, split.path)
        except StoreError:
            if s.authed:
                raise
            route = None  # an unknown path tells nothing before authentication either
        if route is None or not (route.public or s.authed):
            raise AuthError(UNPROVEN)
        if route.public and head.length > PUBLIC_BODY:
            raise TooLargeError(f"at most {PUBLIC_BODY} bytes before authenticating")
        if route.body == "none" and head.length:
            raise BadRequestError(f"{head.method} {split.path[:200]} takes no body")
        if route.body == "json" and head.length > MAX_JSON:
            raise TooLargeError(f"JSON body of {head.length} bytes exceeds {MAX_JSON}")
        return req, route

    def _find(self, req: Request, path: str) -> Route:
        allowed = False
        for route in self.routes:
            m = route.pattern.match(path)
            if m:
                allowed = True
                if route.method == req.method:
                    req.params.update(m.groupdict())
                    return route
        if allowed:
            raise BadRequestError(f"method {req.method[:20]!r} not allowed on {path[:200]}")
        raise NotFoundError(f"no such endpoint: {req.method[:20]} {path[:200]}")


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


def _auth_left(s: Session) -> float:
    """Seconds the connection of `s` has left to authenticate."""
    return s.since + AUTH_TIMEOUT - time.monotonic()


def _shut(sock: socket.socket) -> None:
    """End a connection its own thread is serving (that thread sees EOF and closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _reject(sock: socket.socket, why: str, error: StoreError | None = None) -> None:
    try:
        sock.settimeout(1.0)
        send_error(Conn(sock), error or StoreUnavailable(why), close=True)
    except OSError:
        pass
    finally:
        sock.close()
