"""The memory a benchmark's processes hold, sampled from /proc while they run (benchmarks/bench_sweep.py)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


class Peak:
    """The peak memory of this process's descendants while it runs: their anonymous memory plus the files
    of the stores' (and `dirs`') shared-memory directories, sampled every `every` seconds."""

    def __init__(self, dirs: list[Path], every: float = 0.2) -> None:
        self.dirs, self.every, self.peak = dirs, every, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self) -> Peak:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def run(self) -> None:
        while not self.done.wait(self.every):
            with contextlib.suppress(OSError, ValueError):
                self.peak = max(self.peak, self.sample())

    def sample(self) -> int:
        pids = descendants(os.getpid())
        held = sum(anon(p) for p in pids)
        stores = [d for p in pids for d in Path(f"/proc/{p}/root/dev/shm").glob(f"tenplex-*-{p}")]
        return held + sum(tree_bytes(d) for d in [*stores, *self.dirs])


def descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        kids = [p for p, pp in parent.items() if pp == todo[-1]]
        todo.pop()
        out += kids
        todo += kids
    return out


PAGE = os.sysconf("SC_PAGE_SIZE")


def anon(pid: int) -> int:
    """A process's resident anonymous memory (bytes; resident less file-backed and shared memory, from
    /proc/PID/statm); 0 once it is gone. Why not smaps_rollup's Pss_Anon: it walks the process's page
    tables under its memory-map lock every sample, which slowed the very saves and loads being timed (the
    ranks map and unmap the stores' files); statm reads counters. The ranks are not forks, so their
    anonymous pages are their own and the two agree."""
    try:
        fields = Path(f"/proc/{pid}/statm").read_text().split()
    except OSError:
        return 0
    return (int(fields[1]) - int(fields[2])) * PAGE


def tree_bytes(d: Path) -> int:
    total = 0
    for root, _, files in os.walk(d):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_blocks * 512
    return total
