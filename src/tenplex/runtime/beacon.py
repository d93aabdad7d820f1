"""An agent's beacon: its status in the rendezvous store, the sign of life the other agents watch."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .channel import put


class Beacon(threading.Thread):
    """This agent's status in the rendezvous store, written every second by a thread of its own, whatever
    the main loop waits for (a round may take long to park): the other agents take only silence, a dead or
    cut-off host, for a lost member."""

    def __init__(self, base: dist.Store, key: str, status: Callable[[], dict[str, Any]]) -> None:
        super().__init__(name="tenplex-beacon", daemon=True)
        self.store = base.clone() if hasattr(base, "clone") else base  # its own connection
        self.key, self.status, self.stop = key, status, threading.Event()
        self.start()

    def run(self) -> None:
        beat = 0
        while not self.stop.is_set():
            beat += 1
            try:
                put(self.store, self.key, json.dumps({**self.status(), "beat": beat, "time": time.time()}))
            except RuntimeError:  # the rendezvous store is gone: the main loop finds out too
                return
            self.stop.wait(1.0)
