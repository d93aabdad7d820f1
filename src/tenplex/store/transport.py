"""The client's transport: one store URL, a pool of keep-alive connections, retries with backoff, and
the daemon's JSON errors mapped back to the `StoreError` class it raised.

A client of a store on this host (one it shares memory with) sends its requests over the store's Unix
socket when there is one, after checking with SO_PEERCRED that the process serving it is this user or root;
TCP otherwise, or when that check fails. Each new TCP connection first passes the handshake of `auth` (the
store proves it holds the token before this side proves the same; the token never travels), and is then
pooled and reused like any other.

Every store request is idempotent, so a request whose connection fails is retried; a response body is
either JSON or read by the caller's `reader` straight into its memory (`read_body.into`).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from ..util import env, logs
from .auth import HANDSHAKE_TIMEOUT, handshake, token_file
from .errors import AuthError, StoreError, StoreUnavailable, error_from_payload
from .protocol import (
    DEFAULT_PORT,
    Closed,
    Conn,
    connect,
    connect_unix,
    content_length,
    json_body,
    parse_url,
    trusted_uid,
)
from .read_body import Reader
from .shm import host_id

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
T = TypeVar("T")
log = logs.get("store")


def default_url() -> str:
    return env.get(env.STORE) or DEFAULT_URL


def default_token() -> str | None:
    """The token a client sends when given none: `TENPLEX_STORE_TOKEN`, else this user's token file (the one
    a store writes on its first start, AuthError when that file is not safe to trust), else none."""
    token = env.get(env.STORE_TOKEN)
    if token:
        return token
    return token_file(None)


def owned_dir(path: str) -> bool:
    """Whether `path` is a directory (not a symlink) of this user or root: what a same-host store reports
    as its blob directory is used only then (another user could have answered on the store's port)."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return False
    if not stat.S_ISDIR(st.st_mode) or not trusted_uid(st.st_uid):
        log.warning("not using %s as a store's blob directory: not a directory of this user or root", path)
        return False
    return True


class Leased(NamedTuple):
    """An answer and the connection it came on, kept out of the pool: what the daemon leased to that
    connection (`answer["lease"]`) stays held until `Transport.end_lease` or until the connection closes
    (None: the store closed it, which ended the lease)."""

    answer: Any
    conn: Conn | None


class Transport:
    """Pooled HTTP/1.1 exchanges with one store daemon. Thread-safe: concurrent calls use separate
    connections."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        local: bool | None = None,
        timeout: float = 120.0,
        retries: int = 3,
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        self.host, self.port = parse_url(self.url)
        self.token = token if token is not None else default_token()
        self.timeout, self.retries = timeout, retries
        self.local = local
        self.use_unix = local is not False  # a client told the store is remote (local=False) stays on TCP
        self._unix: str | None = None  # the store's Unix socket once known ("" for none / not trusted)
        self._pool: list[Conn] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, local={self.local})"

    @property
    def is_local(self) -> bool:
        """Whether the daemon shares this machine's memory (decided once, from its `/v1/local` answer)."""
        if self.local is None:
            self._probe()
        return bool(self.local)

    def _probe(self, conn: Conn | None = None) -> None:
        """Ask the store (over TCP, on a proven connection when there is a token; on `conn`, tried once,
        when given) where it runs: shared memory and its Unix socket, if on this host. What it says is
        checked before it is used (`owned_dir`; the socket's server uid at each connect)."""
        self._unix = ""  # the probe itself goes over TCP
        try:  # its connection is not pooled: the next request may go by the socket
            h, kept = self.lease("GET", "/v1/local", conn=conn)
        except BaseException:
            self._unix = None
            raise
        if kept is not None:
            kept.close()
        here = h.get("host_id") == host_id()
        if self.local is None:
            self.local = here and owned_dir(str(h.get("shm_dir")))
        path = str(h.get("unix") or "")
        self._unix = path if here and self.use_unix and os.path.exists(path) else ""

    def _conn(self) -> Conn:
        while True:
            with self._lock:
                if not self._pool:
                    break
                conn = self._pool.pop()
            if conn.pending or conn.open():
                return conn
            conn.close()  # the store closed it while it was idle (its idle timeout, a restart)
        return self._new_conn()

    def _new_conn(self) -> Conn:
        if self.use_unix:
            if self._unix is None:
                self._probe(self._tcp())
            if self._unix:
                try:
                    return connect_unix(self._unix, self.timeout)
                except AuthError as e:  # someone else's socket: never again, and nothing sent to it
                    log.warning("%s; using TCP for %s", e, self.url)
                    self._unix = ""
                except StoreUnavailable:  # gone (the store restarted?): TCP this time, ask again next time
                    self._unix = None
        return self._tcp()

    def _tcp(self) -> Conn:
        """A new TCP connection, authenticated by the handshake when there is a token (a client without
        one is answered 401 on it, but for the public routes)."""
        conn = connect(self.host, self.port, self.timeout)
        if self.token:
            try:
                handshake(conn, self.url, self.token, min(self.timeout, HANDSHAKE_TIMEOUT))
            except BaseException:
                conn.close()
                raise
        return conn

    @staticmethod
    def _settle(conn: Conn) -> None:
        """Read and drop the answers of requests sent on `conn` without waiting (`send_only`). Called after
        the next request was sent, so the daemon serves both in one go (pipelined, in order)."""
        while conn.pending:
            _, rh = conn.read_head()
            try:
                conn.read_json(content_length(rh))
            except StoreError as e:
                raise Closed(str(e)) from None
            conn.pending -= 1
            if rh.get("connection", "").lower() == "close":
                raise Closed("the store closed the connection")

    def send_only(self, method: str, path: str, payload: Any, conn: Conn | None = None) -> None:
        """Send a request (on `conn`, else on a pooled connection) and give the connection back without
        waiting for the answer (read by its next user): for requests whose answer does not matter, such as
        ending a lease."""
        conn = conn if conn is not None else self._conn()
        data = json_body(payload)
        headers = {"Host": f"{self.host}:{self.port}", "Content-Length": str(len(data)),
                   "Content-Type": "application/json"}  # fmt: skip
        try:
            conn.send_head(f"{method} {path} HTTP/1.1", headers, data)
        except OSError:
            conn.close()  # closing the connection ends what it held as well
            return
        conn.pending += 1
        self._give_back(conn)

    def _give_back(self, conn: Conn) -> None:
        with self._lock:
            self._pool.append(conn)

    def close(self) -> None:
        """Close pooled connections (the client stays usable)."""
        with self._lock:
            pool, self._pool = self._pool, []
        for c in pool:
            c.close()

    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        body: Sequence[memoryview] | None = None,
        reader: Reader[T] | None = None,
        conn: Conn | None = None,
    ) -> Any:
        """One HTTP exchange; retried with backoff when the connection fails (all store requests are
        idempotent). `reader` consumes a 200 response body itself; otherwise the JSON body is returned.
        `conn`: send it there (a connection kept by `lease`), tried once."""
        answer, kept = self._exchange(method, path, payload, body, reader, conn)
        if kept is not None:
            self._give_back(kept)
        return answer

    def lease(self, method: str, path: str, payload: Any = None, conn: Conn | None = None) -> Leased:
        """`request`, keeping the connection out of the pool: what the daemon leased to it stays held
        until `end_lease` (or until the connection closes)."""
        return Leased(*self._exchange(method, path, payload, None, None, conn))

    def end_lease(self, leased: Leased) -> None:
        """End a lease on the connection that holds it, without waiting for the answer (a round trip per
        read otherwise); if sending fails the connection is closed, which ends the lease too."""
        if leased.conn is not None:
            self.send_only("POST", "/v1/release", {"lease": leased.answer["lease"]}, leased.conn)

    def _exchange(
        self,
        method: str,
        path: str,
        payload: Any,
        body: Sequence[memoryview] | None,
        reader: Reader[T] | None,
        given: Conn | None,
    ) -> tuple[Any, Conn | None]:
        """The answer and the connection it came on (None when the store closed it), after as many
        attempts as a failed connection allows: `retries`, or one on a `given` connection."""
        data = json_body(payload) if payload is not None else b""
        length = sum(len(b) for b in body) if body is not None else len(data)
        headers = {"Host": f"{self.host}:{self.port}", "Content-Length": str(length)}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        start = f"{method} {path} HTTP/1.1"
        retries = 0 if given is not None else self.retries
        for attempt in range(retries + 1):
            try:
                conn = given if given is not None else self._conn()
                return self._once(conn, start, headers, data if body is None else body, reader)
            except StoreError as e:
                if not isinstance(e, StoreUnavailable) or attempt == retries or not e.retry:
                    raise
            except (OSError, Closed, ValueError, IndexError) as e:
                if attempt == retries:
                    raise StoreUnavailable(f"{self.url}: {method} {path} failed: {e!r}") from e
            time.sleep(0.05 * 4**attempt)
        raise AssertionError("unreachable")

    def _once(
        self,
        conn: Conn,
        start: str,
        headers: dict[str, str],
        body: bytes | Sequence[memoryview],
        reader: Reader[T] | None,
    ) -> tuple[Any, Conn | None]:
        """One attempt on `conn`. An error answer gives the connection back (it is still in step) before
        it is raised; any other failure closes it."""
        try:
            status, rh = self._send(conn, start, headers, body)
            code = int(status.split(" ", 2)[1])
            n = content_length(rh)
            answer = reader(conn, rh, n) if code == 200 and reader is not None else conn.read_json(n)
        except BaseException:
            conn.close()
            raise
        kept: Conn | None = conn
        if rh.get("connection", "").lower() == "close":
            conn.close()
            kept = None
        if code == 200:
            return answer, kept
        if kept is not None:
            self._give_back(kept)
        raise error_from_payload(code, answer)

    def _send(
        self, conn: Conn, start: str, headers: dict[str, str], body: bytes | Sequence[memoryview]
    ) -> tuple[str, dict[str, str]]:
        """Send a request and read its answer's head. A store may answer early and close (507, 413, 401)
        before the body is all sent: that answer is read, and the send's error raised only without one."""
        unsent: OSError | None = None
        try:
            if isinstance(body, bytes):
                conn.send_head(start, headers, body)
            else:
                conn.send_head(start, headers)
                for piece in body:
                    conn.send(piece)
        except OSError as e:
            unsent = e
        try:
            self._settle(conn)
            return conn.read_head()
        except (OSError, Closed):
            if unsent is not None:
                raise unsent from None
            raise
