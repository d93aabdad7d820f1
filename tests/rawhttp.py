"""Raw HTTP/1.1 over a plain socket, for the store's hostile-input and hardening tests: requests built
byte for byte (no client library to tidy them up) and answers read without trusting the daemon. A socket
authenticates with the store's handshake first when given the token (`authed`)."""

from __future__ import annotations

import json
import socket

from tenplex.store.auth import handshake
from tenplex.store.protocol import Conn


def addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def req(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    """One request with a Content-Length; `extra` header lines verbatim."""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def authed(url: str, token: str | None, timeout: float = 10) -> socket.socket:
    """A new connection to the store at `url`, authenticated by the handshake when `token` is given."""
    s = socket.create_connection(addr(url), timeout=timeout)
    if token is not None:
        try:
            handshake(Conn(s), url, token)
        except BaseException:
            s.close()
            raise
    return s


def exchange(
    url: str, data: bytes, shut: bool = True, timeout: float = 10, token: str | None = None
) -> tuple[int, dict, bool]:
    """Send raw bytes (after the handshake when given the token); (status, JSON body, whether the daemon
    then closed the connection)."""
    with authed(url, token, timeout) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        length = int(
            next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        )
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        rest = body[length:]
        closed = False
        if not rest:
            try:
                closed = s.recv(65536) == b""
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                closed = False
        return status, json.loads(body[:length]), closed


def write_token(path, token: str) -> str:
    """Write a token file a store and its clients accept (this user's, mode 0600); its path."""
    path.write_text(token + "\n")
    path.chmod(0o600)
    return str(path)
