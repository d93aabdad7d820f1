"""Ports for rendezvous and test daemons."""

from __future__ import annotations

import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (a process group's rendezvous, a test store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(host: str, port: int, timeout: float, poll: float = 0.002) -> bool:
    """Wait until something accepts connections on `host:port`; False after `timeout` seconds.

    Why: a process group's non-zero ranks connect to rank 0's TCPStore, and one that tries before rank 0
    listens is refused and backs off for much longer than rank 0 needs to start listening. Polling every
    few ms and only then creating the process group turns that into the time rank 0 actually needs
    (the `process group` part of each change's downtime in `results/demo.json`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.05, min(1.0, timeout))).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
