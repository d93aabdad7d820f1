"""Store errors: one class per HTTP error kind, so the client re-raises exactly what the daemon reported."""

from __future__ import annotations

from ..ptc import TenplexError


class StoreError(TenplexError):
    """Base of every error the tensor store reports; `status` is the HTTP status the daemon answers with."""

    status = 500
    kind = "internal"


class BadRequestError(StoreError, ValueError):
    """Malformed request: bad key, box, dtype, shape, body or header."""

    status = 400
    kind = "bad_request"


class AuthError(StoreError):
    """A connection that did not prove it holds the token, a server that did not, or a token file or
    same-host path not safe to trust."""

    status = 401
    kind = "unauthorized"


class NotFoundError(StoreError, KeyError):
    """Unknown job, version (or version not committed yet) or blob."""

    status = 404
    kind = "not_found"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class RequestTimeout(StoreError):
    """A request head that did not arrive in time (the connection is closed)."""

    status = 408
    kind = "timeout"


class ConflictError(StoreError):
    """The request contradicts the state: writing into a committed version, committing unsealed blobs, ..."""

    status = 409
    kind = "conflict"


class TooLargeError(StoreError):
    """A request line, header section, body or box list beyond the daemon's limits."""

    status = 413
    kind = "too_large"


class ChecksumError(StoreError):
    """Stored bytes no longer match the checksum taken when they were written: they are never returned."""

    status = 500
    kind = "checksum"


class MemoryLimitError(StoreError):
    """The write would take the store beyond its memory limit; nothing committed is evicted to make room."""

    status = 507
    kind = "memory_limit"


class StoreUnavailable(StoreError, ConnectionError):
    """The store could not be reached (after retries) or closed the connection."""

    status = 503
    kind = "unavailable"
    retry = True  # whether another try may get an answer (False: the host did not answer at all)


_BY_KIND: dict[str, type[StoreError]] = {
    c.kind: c
    for c in (
        StoreError,
        BadRequestError,
        AuthError,
        NotFoundError,
        ConflictError,
        RequestTimeout,
        TooLargeError,
        ChecksumError,
        MemoryLimitError,
        StoreUnavailable,
    )
}


def error_from_payload(status: int, payload: object) -> StoreError:
    """Rebuild the daemon's error on the client side from its JSON error body."""
    if isinstance(payload, dict):
        cls = _BY_KIND.get(str(payload.get("error")), StoreError)
        return cls(str(payload.get("message", f"HTTP {status}")))
    return StoreError(f"HTTP {status}: {payload!r}")
