"""Mutual proof of the token on each new TCP connection; the token itself never travels.

Client → `POST /v1/hello {nonce: Nc, url}` → server answers `{proof: MAC("server", Nc, url), nonce: Ns}`
(only for a URL that is its own). The client checks it before sending anything else (`AuthError`
otherwise), then `POST /v1/auth {proof: MAC("client", Ns, Nc, url)}`; the server marks that connection
authenticated and later requests on it need nothing more. MAC is HMAC-SHA256 keyed by the token over
length-prefixed fields after a domain tag, so a proof cannot be replayed on another connection (fresh
nonces on both sides), reflected (the role is in the MAC) or borrowed for another address (the URL is).

Stores proving themselves to stores (relay fetches, replica pushes) and every client use this one
handshake. A store answers only for a URL that is its own (`is_own_url`: its port, and a host that is its
advertised name, loopback or one of its addresses; no DNS lookup on a caller's behalf), so a listener on a
dead store's port cannot answer, nor relay the challenge to a real store elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
from typing import Any

from ..util import TokenFileError, read_token
from .errors import AuthError, BadRequestError, StoreError, StoreUnavailable
from .protocol import Closed, Conn, content_length, json_body, parse_url

DOMAIN = b"tenplex-store-auth-v1\0"
HANDSHAKE_TIMEOUT = 10.0  # seconds a server has to answer each step of the handshake


def token_file(path: str | None, create: bool = False) -> str | None:
    """`util.read_token` (the file checked before it is trusted), a refused file as a one-line AuthError."""
    try:
        return read_token(path, create)
    except TokenFileError as e:
        raise AuthError(str(e)) from None


def mac(token: str, role: str, *fields: str) -> str:
    """HMAC-SHA256 under `token` of the role and fields, each length-prefixed (no two inputs collide)."""
    msg = bytearray(DOMAIN)
    for f in (role, *fields):
        b = f.encode()
        msg += len(b).to_bytes(4, "big") + b
    return hmac.new(token.encode(), bytes(msg), hashlib.sha256).hexdigest()


def server_proof(token: str, nc: str, url: str) -> str:
    return mac(token, "server", nc, url.rstrip("/"))


def client_proof(token: str, ns: str, nc: str, url: str) -> str:
    return mac(token, "client", ns, nc, url.rstrip("/"))


def check_nonce(nonce: Any) -> str:
    """A nonce as sent: 16 to 128 characters; BadRequestError otherwise."""
    if not (isinstance(nonce, str) and 16 <= len(nonce) <= 128):
        raise BadRequestError("a nonce must be 16 to 128 characters")
    return nonce


class Challenge:
    """The server's half of one connection's handshake: what `/v1/hello` asked and answered, checked by
    `/v1/auth` once (a failed or repeated `/v1/auth` needs a new hello, on a new connection)."""

    def __init__(self, token: str, nc: str, url: str) -> None:
        self.ns = secrets.token_hex(16)
        self.expected = client_proof(token, self.ns, nc, url)
        self.answer = {"proof": server_proof(token, nc, url), "nonce": self.ns}

    def check(self, proof: Any) -> None:
        if not isinstance(proof, str) or not _same(proof, self.expected):
            raise AuthError("wrong proof: this client does not hold the store's token")


def handshake(conn: Conn, url: str, token: str, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Prove to the server at the other end of `conn` (dialed as `url`) that this side holds `token`, after
    it proved the same: AuthError, with nothing more sent, when it does not; StoreUnavailable when it
    cannot be reached or is full. The connection then carries requests with no credentials."""
    url = url.rstrip("/")
    nc = secrets.token_hex(16)
    before = conn.sock.gettimeout()
    conn.sock.settimeout(timeout)
    try:
        answer = _post(conn, url, "/v1/hello", {"nonce": nc, "url": url})
        got, ns = answer.get("proof"), answer.get("nonce")
        if not isinstance(got, str) or not _same(got, server_proof(token, nc, url)):
            raise _unproven(url)
        if not (isinstance(ns, str) and 16 <= len(ns) <= 128):
            raise _unproven(url, "no valid nonce")
        _post(conn, url, "/v1/auth", {"proof": client_proof(token, ns, nc, url)})
    finally:
        try:
            conn.sock.settimeout(before)
        except OSError:  # closed on the way: the caller drops it
            pass


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _unproven(url: str, why: str = "") -> AuthError:
    return AuthError(f"{url} did not prove it holds this store's token{f' ({why})' if why else ''}; "
                     "nothing is sent there")  # fmt: skip


def _post(conn: Conn, url: str, path: str, payload: dict[str, str]) -> dict[str, Any]:
    """One handshake step: its JSON answer, or the error a store unreachable, full or unproven gives."""
    data = json_body(payload)
    headers = {"Host": url.removeprefix("http://"), "Content-Length": str(len(data)),
               "Content-Type": "application/json"}  # fmt: skip
    try:
        conn.send_head(f"POST {path} HTTP/1.1", headers, data)
        status, rh = conn.read_head()
        body = conn.read_json(content_length(rh))
        code = int(status.split(" ", 2)[1])
    except (OSError, Closed) as e:
        raise StoreUnavailable(f"{url}: handshake failed: {e!r}") from e
    except (StoreError, ValueError, IndexError) as e:  # not HTTP, not JSON: not a store
        raise _unproven(url, str(e)) from None
    why = body.get("message") if isinstance(body, dict) else f"HTTP {code}"
    if code == 503:
        raise StoreUnavailable(f"{url}: {why}")
    if code != 200 or not isinstance(body, dict):
        raise _unproven(url, str(why))
    return body


def is_own_url(url: str, own_url: str, port: int, bound: str, arrived: str | None = None) -> bool:
    """Whether `url` reaches this store (listening on `bound`:`port`, advertised as `own_url`). A loopback
    URL is this store's only for a connection that arrived on a loopback address (`arrived`): a listener
    on another host's dead store's port must not borrow this store's answer for its own loopback URL."""
    try:
        host, p = parse_url(url)
        own_host, _ = parse_url(own_url)
    except BadRequestError:
        return False
    if p != port:
        return False
    if arrived is not None and _names_loopback(host) and not _is_loopback(arrived):
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
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _names_loopback(host: str) -> bool:
    return host == "localhost" or _is_loopback(host)


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")
