"""Stores talking to stores: before a daemon sends its token (with a relay fetch or a replica push) to a URL
it was told about, the store there must prove it holds the same token, without the token travelling.

The asker sends a fresh nonce and the URL it dialed to `POST /v1/hello` (the one route answered without
the token); a store answers HMAC(token, nonce, URL) only for a URL that is its own (its port, and a host
that is its advertised name, loopback or one of its addresses: no DNS lookup on the caller's behalf). So a
listener that took a dead store's port cannot answer, and it cannot borrow the answer of a real store
either: that store refuses to vouch for an address that is not its own. The proof is asked on each new
connection, which then carries the token: a proven connection is kept and reused (a process that takes the
port later cannot join a connection already made), a new one proves itself again.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import secrets
import socket
from functools import partial

from .client import StoreClient
from .errors import AuthError, BadRequestError, StoreError, StoreUnavailable
from .protocol import Conn
from .transport import Transport, parse_url

_DOMAIN = b"tenplex-store-hello\0"


def proof(token: str, nonce: str, url: str) -> str:
    msg = _DOMAIN + nonce.encode() + b"\0" + url.rstrip("/").encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def is_own_url(url: str, own_url: str, port: int, bound: str) -> bool:
    """Whether `url` reaches this store (listening on `bound`:`port`, advertised as `own_url`)."""
    try:
        host, p = parse_url(url)
        own_host, _ = parse_url(own_url)
    except BadRequestError:
        return False
    if p != port:
        return False
    if host == own_host or host == "localhost":
        return host != "localhost" or _is_loopback(bound) or _is_wildcard(bound)
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a name that is not ours: never resolved here
    if str(ip) == bound:
        return True
    if not _is_wildcard(bound):
        return False
    if ip.is_loopback:
        return True
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as s:  # binding works only to an address of this host
        try:
            s.bind((str(ip), 0))
            return True
        except OSError:
            return False


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def prove(conn: Conn, url: str, token: str, timeout: float = 10.0) -> None:
    """Raise AuthError unless the store at the other end of `conn` proves it holds `token` (within
    `timeout` seconds). Asked on the very connection that then carries the token, so no listener can take
    the store's place in between."""
    nonce = secrets.token_hex(16)
    t = Transport(url, token="", local=False, retries=0)
    before = conn.sock.gettimeout()
    conn.sock.settimeout(timeout)
    try:  # `hold`: the connection stays the caller's, never pooled here
        answer = t.request("POST", "/v1/hello", {"nonce": nonce, "url": url.rstrip("/")}, hold=[], conn=conn)
    except StoreUnavailable:
        raise
    except StoreError as e:  # not a store, an old one, or one that does not answer for this URL
        raise AuthError(
            f"{url} did not prove it holds this store's token ({e}); nothing is sent there"
        ) from None
    finally:
        with contextlib.suppress(OSError):  # closed when the answer said so: the caller drops it
            conn.sock.settimeout(before)
    got = answer.get("proof") if isinstance(answer, dict) else None
    if not isinstance(got, str) or not hmac.compare_digest(got, proof(token, nonce, url)):
        raise AuthError(f"{url} did not prove it holds this store's token; nothing is sent there")


def proven_client(url: str, token: str | None) -> StoreClient:
    """A network client of the store at `url` that carries `token` only on connections where that store
    proved it holds it (each new connection proves it first; nothing to prove without a token)."""
    if token is None:
        return StoreClient(url, token="", local=False)
    return StoreClient(url, token=token, local=False, on_connect=partial(prove, url=url, token=token))
