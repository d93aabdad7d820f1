"""Ports for rendezvous and test daemons."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (a process group's rendezvous, a test store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
