"""Raw HTTP/1.1 over a plain socket, for the store's hostile-input and hardening tests: requests built
byte for byte (no client library to tidy them up) and answers read without trusting the daemon."""

from __future__ import annotations

import json
import socket


def addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def req(method: str, path: str, body: bytes = b"", extra: str = "", token: str | None = None) -> bytes:
    """One request with a Content-Length; `extra` header lines verbatim; a bearer token if given."""
    auth = f"Authorization: Bearer {token}\r\n" if token is not None else ""
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def exchange(url: str, data: bytes, shut: bool = True, timeout: float = 10) -> tuple[int, dict, bool]:
    """Send raw bytes; (status, JSON body, whether the daemon then closed the connection)."""
    with socket.create_connection(addr(url), timeout=timeout) as s:
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
