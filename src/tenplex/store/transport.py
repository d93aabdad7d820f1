"""The client's transport: one store URL, a pool of keep-alive connections, retries with backoff, and
the daemon's JSON errors mapped back to the `StoreError` class it raised.

A client of a store on this host (one it shares memory with) sends its requests over the store's Unix
socket when there is one, after checking with SO_PEERCRED that the process serving it is this user or root;
TCP otherwise, or when that check fails. Each new TCP connection first passes the handshake of `auth` (the
store proves it holds the token before this side proves the same; the token never travels), and is then
pooled and reused like any other.

Every store request is idempotent, so a request whose connection fails is retried; a response body is
either JSON or read by the caller's `reader` straight into its memory (`into`).
"""

from __future__ import annotations

import json
import os
import stat
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..ptc import ITEM_SIZE, Box
from ..util import env, logs
from .auth import HANDSHAKE_TIMEOUT, handshake, token_file
from .boxio import as_bytes
from .checksum import cuts, digest
from .errors import (
    AuthError,
    ChecksumError,
    StoreError,
    StoreUnavailable,
    error_from_payload,
)
from .keys import check_out
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
from .shm import host_id

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
PREAMBLE = struct.Struct("<Q")  # length of the JSON part description that precedes raw read bodies
T = TypeVar("T")
log = logs.get("store")
Reader = Callable[[Conn, dict[str, str], int], T]


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
        self._local = local
        self.use_unix = local is not False  # a client told the store is remote (local=False) stays on TCP
        self._unix: str | None = None  # the store's Unix socket once known ("" for none / not trusted)
        self._pool: list[Conn] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, local={self._local})"

    @property
    def is_local(self) -> bool:
        """Whether the daemon shares this machine's memory (decided once, from its `/v1/local` answer)."""
        if self._local is None:
            self._probe()
        return bool(self._local)

    def _probe(self, conn: Conn | None = None) -> None:
        """Ask the store (over TCP, on a proven connection when there is a token; on `conn`, tried once,
        when given) where it runs: shared memory and its Unix socket, if on this host. What it says is
        checked before it is used (`owned_dir`; the socket's server uid at each connect)."""
        self._unix = ""  # the probe itself goes over TCP
        held: list[Conn] = []  # its connection is not pooled: the next request may go by the socket
        try:
            h = self.request("GET", "/v1/local", hold=held, conn=conn)
        except BaseException:
            self._unix = None
            raise
        finally:
            for c in held:
                c.close()
        here = h.get("host_id") == host_id()
        if self._local is None:
            self._local = here and owned_dir(str(h.get("shm_dir")))
        path = str(h.get("unix") or "")
        self._unix = path if here and self.use_unix and os.path.exists(path) else ""

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/v1/health")

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

    def send_only(self, conn: Conn, method: str, path: str, payload: Any) -> None:
        """Send a request on `conn` and give the connection back without waiting for the answer (read by
        its next user): for requests whose answer does not matter, such as ending a lease."""
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
        hold: list[Conn] | None = None,
        conn: Conn | None = None,
    ) -> Any:
        """One HTTP exchange; retried with backoff when the connection fails (all store requests are
        idempotent). `reader` consumes a 200 response body itself; otherwise the JSON body is returned.
        `hold`: the connection is appended to it instead of going back to the pool (what the daemon leased
        to it stays held until the caller's next request on it, `conn=`, which is tried once)."""
        data = json_body(payload) if payload is not None else b""
        length = sum(len(b) for b in body) if body is not None else len(data)
        headers = {"Host": f"{self.host}:{self.port}", "Content-Length": str(length)}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        start = f"{method} {path} HTTP/1.1"
        given, retries = conn, 0 if conn is not None else self.retries
        for attempt in range(retries + 1):
            conn = None
            try:
                conn = given if given is not None else self._conn()
                unsent: OSError | None = None
                try:
                    if body is None:
                        conn.send_head(start, headers, data)
                    else:
                        conn.send_head(start, headers)
                        for piece in body:
                            conn.send(piece)
                except OSError as e:  # the store may have answered early and closed (507, 413, 401)
                    unsent = e
                try:
                    self._settle(conn)
                    status, rh = conn.read_head()
                except (OSError, Closed):
                    if unsent is not None:
                        raise unsent from None
                    raise
                n = content_length(rh)
                if status.split(" ", 2)[1:2] == ["200"] and reader is not None:
                    result = reader(conn, rh, n)
                else:
                    result = conn.read_json(n)
                    code = int(status.split(" ", 2)[1])
                    if code != 200:
                        if rh.get("connection", "").lower() == "close":
                            conn.close()
                        else:
                            self._give_back(conn)
                        conn = None
                        raise error_from_payload(code, result)
                if rh.get("connection", "").lower() == "close":
                    conn.close()
                elif hold is not None:
                    hold.append(conn)
                else:
                    self._give_back(conn)
                return result
            except StoreError as e:
                if conn is not None:
                    conn.close()
                if not isinstance(e, StoreUnavailable) or attempt == retries or not e.retry:
                    raise
            except (OSError, Closed, ValueError, IndexError) as e:
                if conn is not None:
                    conn.close()
                if attempt == retries:
                    raise StoreUnavailable(f"{self.url}: {method} {path} failed: {e!r}") from e
            time.sleep(0.05 * 4**attempt)
        raise AssertionError("unreachable")


def into(outs: list[np.ndarray], sums: dict[int, list[int]] | None = None) -> Reader[None]:
    """A response reader that receives the raw parts of a read straight into `outs`, hashing each piece
    as it lands and checking it against the checksums the store sends after the parts (when it does).

    The store sends the saved checksums of the whole chunks a box covers, so this check is the one that
    catches bytes corrupted in the store's memory as well as on the way. With `sums`, each `out` whose
    part starts on a chunk boundary gets its verified checksums there (by `id(out)`): they are that
    array's own chunk checksums, which a store keeping the bytes need not compute again."""

    def read(conn: Conn, headers: dict[str, str], length: int) -> None:
        head = bytearray(PREAMBLE.size)
        conn.read_into(memoryview(head))
        (n,) = PREAMBLE.unpack(head)
        meta = json.loads(conn.read_bytes(n))
        left = length - PREAMBLE.size - n
        checked = "digests" in meta
        try:
            views, pieces = [], []
            for part, out in zip(meta["parts"], outs, strict=True):
                dt = part["dtype"]
                if dt not in ITEM_SIZE:
                    raise StoreError(f"store answered with unknown dtype {dt!r}")
                views.append(as_bytes(check_out(out, dt, Box.full(tuple(out.shape)))))
                if len(views[-1]) != part["nbytes"]:
                    raise StoreError(f"store answered {part['nbytes']} bytes for a {len(views[-1])}-byte box")
                pieces.append(cuts(len(views[-1]), int(part.get("skew", 0))) if checked else [])
            count = sum(len(p) for p in pieces)
            if checked and (meta["digests"] != count or left != sum(map(len, views)) + 8 * count):
                raise StoreError("store answered a read with a malformed checksum trailer")
        except StoreError:
            conn.drain(left)
            raise
        got = []
        for v, cut in zip(views, pieces):
            if not checked:
                conn.read_into(v)
            for a, b in cut:  # hashed right after it arrived, while it is in cache
                conn.read_into(v[a:b])
                got.append(digest(v[a:b]))
        if checked:
            trailer = bytearray(8 * count)
            conn.read_into(memoryview(trailer))
            sent = list(struct.unpack(f"<{count}Q", trailer))
            if sent != got:
                raise ChecksumError(_mismatch(sent, got, pieces))
            if sums is not None:
                at = 0
                for part, out, cut in zip(meta["parts"], outs, pieces):
                    if not int(part.get("skew", 0)):
                        sums[id(out)] = got[at : at + len(cut)]
                    at += len(cut)

    return read


def _mismatch(sent: list[int], got: list[int], pieces: list[list[tuple[int, int]]]) -> str:
    """Which part and bytes of a read failed their checksum."""
    first = next(i for i, (a, b) in enumerate(zip(sent, got)) if a != b)
    for k, cut in enumerate(pieces):
        if first < len(cut):
            lo, hi = cut[first]
            return (f"a read's bytes {lo}..{hi} of box {k} do not match the store's checksums (corrupted in "
                    "the store's memory or on the way): not returned")  # fmt: skip
        first -= len(cut)
    raise AssertionError("unreachable")
