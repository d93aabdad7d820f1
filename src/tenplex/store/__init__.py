"""The tensor store: a per-host daemon holding PTC snapshots in shared memory, and its client.

Same-host clients write and read blobs through shared memory; other hosts use a lean HTTP/1.1 path on raw
sockets. Versions are committed atomically, blobs carry per-chunk checksums, committed versions can be
replicated to peer stores, and a relay lets one host fetch remote bytes once for all its ranks.
"""

from .client import DEFAULT_PORT, DEFAULT_URL, Held, StoreClient
from .errors import (
    AuthError,
    BadRequestError,
    ChecksumError,
    ConflictError,
    MemoryLimitError,
    NotFoundError,
    StoreError,
    StoreUnavailable,
    TooLargeError,
)
from .fanout import hold_relayed_many, read_many, relay_many
from .process import StoreProcess, start_store

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_URL",
    "AuthError",
    "BadRequestError",
    "ChecksumError",
    "ConflictError",
    "Held",
    "MemoryLimitError",
    "NotFoundError",
    "StoreClient",
    "StoreError",
    "StoreProcess",
    "StoreUnavailable",
    "TooLargeError",
    "hold_relayed_many",
    "read_many",
    "relay_many",
    "start_store",
]
