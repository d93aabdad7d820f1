"""Request heads parsed by llhttp (Node.js's HTTP parser, through `httptools`), not by hand.

Only the head goes through the parser: the server cuts it at the blank line and bodies are received
straight into their final memory (`Conn.read_into`). On top of llhttp's checks (request line, header
syntax, Content-Length digits, duplicate Content-Length, Content-Length with Transfer-Encoding) the store
refuses anything that would let two parties frame one byte stream differently: Transfer-Encoding of any
kind, Upgrade, a repeated header that must be single, a Content-Length of more than 15 digits.
"""

from __future__ import annotations

from dataclasses import dataclass

import httptools

from .errors import BadRequestError, StoreError, TooLargeError
from .protocol import MAX_HEADERS, MAX_LINE

SINGLE = frozenset({b"content-length", b"authorization", b"connection", b"host", b"content-type"})


@dataclass
class Head:
    method: str
    target: str
    headers: dict[str, str]  # lower-cased names
    length: int  # the body's Content-Length (0 when absent)
    keep_alive: bool  # HTTP/1.1 without `Connection: close` (or HTTP/1.0 with keep-alive)


class _Collect:
    __slots__ = ("headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            raise TooLargeError(f"more than {MAX_HEADERS} headers")
        self.headers.append((name.lower(), value))


def parse_head(raw: bytes) -> Head:
    """The head `raw` (request line to the blank line included); BadRequestError for anything else."""
    c = _Collect()
    p = httptools.HttpRequestParser(c)
    try:
        p.feed_data(raw)
    except httptools.HttpParserUpgrade:
        raise BadRequestError("protocol upgrades are not supported") from None
    except httptools.HttpParserError as e:
        cause = e.__context__ if isinstance(e.__context__, StoreError) else None
        raise cause or BadRequestError(f"malformed request head: {e}") from None
    if len(c.url) > MAX_LINE:
        raise TooLargeError(f"request target longer than {MAX_LINE} bytes")
    headers: dict[str, str] = {}
    for name, value in c.headers:
        key = name.decode("latin-1")
        if key in headers and name in SINGLE:
            raise BadRequestError(f"header {key!r} given twice")
        headers[key] = value.decode("latin-1").strip() if key not in headers else headers[key]
    if "transfer-encoding" in headers:
        raise BadRequestError("Transfer-Encoding is not supported; send Content-Length")
    raw_length = headers.get("content-length", "0")
    if not (raw_length.isascii() and raw_length.isdigit()) or len(raw_length) > 15:
        raise BadRequestError(f"invalid Content-Length {raw_length[:40]!r}")
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "keep-alive" in tokens if p.get_http_version() == "1.0" else "close" not in tokens
    return Head(
        p.get_method().decode("ascii", "replace"), c.url.decode("latin-1"), headers, int(raw_length), keep
    )
