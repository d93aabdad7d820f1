"""A minimal HTTP/1.1 framing over raw sockets, shared by the daemon and the client.

Only what the store needs: keep-alive, Content-Length bodies (no chunked encoding), JSON for control
messages and raw bytes for blob bodies. Bodies are received straight into caller-provided memory with
`recv_into` (many small ones by one `recvmsg_into`) and sent from memoryviews with `sendall` (many by one
`sendmsg`), which is what keeps the bulk path near the speed of a raw socket (`python
benchmarks/bench_store.py`: "net read box 256 MiB" against its raw-socket baseline in
results/bench_store.json).
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import struct
import time
from typing import Any
from urllib.parse import urlsplit

from .errors import AuthError, BadRequestError, RequestTimeout, StoreUnavailable, TooLargeError

DEFAULT_PORT = 7311
MAX_LINE = 8 << 10  # request line / status line
MAX_HEAD = 32 << 10  # whole header section
MAX_HEADERS = 64
MAX_JSON = 64 << 20  # JSON request and response bodies (manifests can be a few MB)
RECV = 256 << 10
IOV = 512  # buffers in one sendmsg / recvmsg_into call (the kernel takes up to 1024)

REASONS = {
    200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 409: "Conflict", 411: "Length Required", 413: "Content Too Large",
    500: "Internal Server Error", 503: "Service Unavailable", 507: "Insufficient Storage",
}  # fmt: skip


class Closed(Exception):
    """The peer closed the connection between messages (normal end of a keep-alive connection)."""


class Conn:
    """One socket with a small read buffer: message heads are parsed from it, bodies bypass it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self.pending = 0  # answers to requests sent without waiting (read before the next request)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def open(self) -> bool:
        """Whether an idle connection can still carry a request: nothing buffered or readable on it (a
        readable idle socket is one the other side closed, or one that sent what nobody asked for)."""
        if self._buf:
            return False
        try:
            poller = select.poll()  # not select(): no limit on the descriptor's number
            poller.register(self.sock, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    # ---- reading

    def read_head_bytes(self, idle: float | None = None, limit: float | None = None) -> bytes:
        """The next message head, through its blank line. `idle`: seconds to wait for its first byte
        (Closed after that, as on a clean EOF); `limit`: seconds from its first byte to its blank line
        (RequestTimeout after that). None: the socket's own timeout per receive."""
        deadline: float | None = None
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(self._buf) > MAX_HEAD:
                raise TooLargeError(f"header section longer than {MAX_HEAD} bytes")
            if self._buf and limit is not None and deadline is None:
                deadline = time.monotonic() + limit
            wait = idle if deadline is None else deadline - time.monotonic()
            if wait is not None:
                if wait <= 0:
                    raise RequestTimeout(f"request head not complete within {limit} s")
                self.sock.settimeout(wait)
            try:
                chunk = self.sock.recv(RECV)
            except TimeoutError:
                if not self._buf.strip():
                    raise Closed from None
                raise RequestTimeout(f"request head not complete within {limit} s") from None
            if not chunk:
                if self._buf.strip():
                    raise BadRequestError("connection closed in the middle of a message head")
                raise Closed
            self._buf += chunk
        if end > MAX_HEAD:
            raise TooLargeError(f"header section longer than {MAX_HEAD} bytes")
        head = bytes(self._buf[: end + 4])
        del self._buf[: end + 4]
        return head

    def read_head(self) -> tuple[str, dict[str, str]]:
        """Start line and lower-cased headers of the next message (the client's reading of responses);
        Closed on a clean EOF before it."""
        head = self.read_head_bytes()[:-4]
        try:
            lines = head.decode("latin-1").split("\r\n")
        except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes everything
            raise BadRequestError("undecodable header") from None
        if len(lines[0]) > MAX_LINE:
            raise TooLargeError(f"start line longer than {MAX_LINE} bytes")
        if len(lines) - 1 > MAX_HEADERS:
            raise TooLargeError(f"more than {MAX_HEADERS} headers")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if not sep or not key or key != key.strip():
                raise BadRequestError(f"malformed header line {line[:80]!r}")
            headers[key.lower()] = value.strip()
        return lines[0], headers

    def read_into(self, dst: memoryview) -> None:
        """Fill `dst` with the next len(dst) body bytes; BadRequestError (truncated) on EOF."""
        self.read_many_into([dst])

    def read_many_into(self, views: list[memoryview]) -> None:
        """Fill each of `views` in turn with the next body bytes, many in one system call (a scatter
        read): a read of many small boxes costs a few calls, not one per box. BadRequestError (truncated)
        on EOF; the caller's list is left as it was."""
        views = [v for v in views if len(v)]
        i = taken = 0
        with memoryview(self._buf) as buf:  # what the head's read took of the body comes first
            while i < len(views) and taken < len(buf):
                have = min(len(views[i]), len(buf) - taken)
                views[i][:have] = buf[taken : taken + have]
                taken += have
                i = _advance(views, i, have)
        del self._buf[:taken]  # once: a cut per view moved the rest of the buffer each time
        while i < len(views):
            got = self.sock.recvmsg_into(views[i : i + IOV])[0]
            if got == 0:
                left = sum(map(len, views[i:]))
                raise BadRequestError(f"truncated body: {left} bytes not received")
            i = _advance(views, i, got)

    def read_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf))
        return bytes(buf)

    def read_json(self, n: int) -> Any:
        if n > MAX_JSON:
            raise TooLargeError(f"JSON body of {n} bytes exceeds {MAX_JSON}")
        return parse_json(self.read_bytes(n) if n else b"null")

    def linger(self, n: int, seconds: float) -> None:
        """Before closing after an early answer: stop sending, then discard (never parse) up to `n` bytes
        the peer is still sending, for at most `seconds`, so that its last writes do not reset the
        connection before it has read the answer."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + seconds
            sink = memoryview(bytearray(RECV))
            n -= len(self._buf)
            self._buf.clear()
            while n > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.sock.settimeout(left)
                got = self.sock.recv_into(sink, min(n, RECV))
                if not got:
                    break
                n -= got
        except OSError:
            pass

    def drain(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, RECV) or 1))
        while n > 0:
            k = min(n, len(scratch))
            self.read_into(scratch[:k])
            n -= k

    # ---- writing

    def send_head(self, start: str, headers: dict[str, str], body: bytes = b"") -> None:
        lines = [start, *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        self.sock.sendall("\r\n".join(lines).encode("latin-1") + body)

    def send(self, data: memoryview | bytes) -> None:
        self.sock.sendall(data)

    def send_many(self, views: list[memoryview]) -> None:
        """Send `views` in order, many in one system call (a gather write): an answer of many small boxes
        costs a few calls, not one per box. The views must stay unchanged until this returns."""
        views = [v for v in views if len(v)]
        i = 0
        while i < len(views):
            i = _advance(views, i, self.sock.sendmsg(views[i : i + IOV]))


def _advance(views: list[memoryview], i: int, done: int) -> int:
    """After `done` more bytes went through `views` from view `i`: the first view not complete, cut to
    what of it is left."""
    while i < len(views) and done >= len(views[i]):
        done -= len(views[i])
        i += 1
    if done:
        views[i] = views[i][done:]
    return i


def parse_url(url: str) -> tuple[str, int]:
    """(host, port) of a store URL `http://HOST:PORT`; BadRequestError for anything else."""
    parts = urlsplit(url)
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        port = -1
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or port < 0:
        raise BadRequestError(f"store URL must look like http://HOST:PORT, got {url!r}")
    return parts.hostname, port


def content_length(headers: dict[str, str]) -> int:
    raw = headers.get("content-length", "0")
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 15:
        raise BadRequestError(f"invalid Content-Length {raw[:40]!r}")
    if "transfer-encoding" in headers:
        raise BadRequestError("Transfer-Encoding is not supported; send Content-Length")
    return int(raw)


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequestError(f"body is not JSON: {e}") from None


def json_body(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


CONNECT_TIMEOUT_S = 5.0  # a host that answers connects in milliseconds; a lost one drops the SYN silently


def connect(host: str, port: int, timeout: float) -> Conn:
    """A TCP connection whose later reads and writes wait up to `timeout`; the connect itself waits at
    most `CONNECT_TIMEOUT_S`, so a lost host costs a load seconds, not the request timeout per retry."""
    try:
        sock = socket.create_connection((host, port), timeout=min(timeout, CONNECT_TIMEOUT_S))
        sock.settimeout(timeout)
    except OSError as e:
        error = StoreUnavailable(f"cannot connect to {host}:{port}: {e}")
        # no answer at all (a lost or cut-off host): trying again costs the same wait for the same silence;
        # a refused connection is retried (a store restarting on its port)
        error.retry = not isinstance(e, TimeoutError) and e.errno not in _SILENT
        raise error from e
    return Conn(sock)


_SILENT = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN}


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix domain socket (SO_PEERCRED: what the
    kernel recorded when it connected or listened, not anything the peer says)."""
    _, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def trusted_uid(uid: int) -> bool:
    """A peer on a store's Unix socket may control it (and a client may trust the server) when it is
    this user or root."""
    return uid in (os.getuid(), 0)


def connect_unix(path: str, timeout: float) -> Conn:
    """A connection to a same-host store's Unix socket, only if the process serving it is this user or
    root (another user could have created a socket at that path first): AuthError otherwise, before
    anything is sent."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise StoreUnavailable(f"cannot connect to {path}: {e}") from e
    uid = peer_uid(sock)
    if not trusted_uid(uid):
        sock.close()
        raise AuthError(f"{path} is served by uid {uid}, not by this user or root: not trusted")
    return Conn(sock)
