"""Raw HTTP/1.1 over a plain socket, for the store's hostile-input and hardening tests: requests built
byte for byte (no client library to tidy them up) and answers read without trusting the daemon. A socket
authenticates with the store's handshake first when given the token (`authed`)."""

from __future__ import annotations

import json
import socket
import threading

from tenplex.store.auth import handshake
from tenplex.store.errors import StoreError
from tenplex.store.protocol import Closed, Conn


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


class Squatter:
    """Another process on a port (a dead store's, or any): records every byte it receives and answers each
    request head with `answer(path, body)` (JSON), or with 404 when that is None. It holds no token, so it
    can never prove itself a store."""

    def __init__(self, port: int = 0, answer=lambda path, body: None) -> None:
        self.sock = socket.create_server(("127.0.0.1", port))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.answer = answer
        self.got = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while self.sock.fileno() >= 0:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._talk, args=(c,), daemon=True).start()

    def _talk(self, c: socket.socket) -> None:
        conn = Conn(c)
        try:
            while True:
                start, headers = conn.read_head()
                body = conn.read_bytes(int(headers.get("content-length", "0")))
                self.got += start.encode() + b"\n" + repr(headers).encode() + b"\n" + body + b"\n"
                payload = self.answer(start.split()[1], json.loads(body) if body else None)
                status = "200 OK" if payload is not None else "404 Not Found"
                data = json.dumps(payload if payload is not None else {"error": "not_found"}).encode()
                conn.send_head(f"HTTP/1.1 {status}", {"Content-Length": str(len(data))}, data)
        except (OSError, Closed, StoreError, ValueError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        """The port is free once this returns (the accepting thread has let go of it)."""
        self.sock.close()
        self.thread.join()
