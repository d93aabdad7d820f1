"""Ports for rendezvous and test daemons."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

LOW_PORT = 10000  # the lowest port handed out below the kernel's ephemeral range
_draw = random.SystemRandom()  # not the `random` a script seeds: two seeded processes would draw alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (a process group's rendezvous, a test store), which another process
    binds seconds later.

    Why below the ephemeral range: a port the kernel handed out (`bind(0)`) comes from the range it also
    gives every outgoing connection, and on a busy host one of those took the port in between now and
    then (EADDRINUSE). Outside it, only another caller that draws the same port in that window can."""
    low = _ephemeral_low()
    for _ in range(64 if low > LOW_PORT + 1000 else 0):
        port = _draw.randrange(LOW_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
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
