"""Host staging for snapshots: a rank's shards copied into reusable host buffers, then written to the store.

Why: an asynchronous snapshot must capture the state of its step, yet writing it to the store (one
allocate request and one copy per tensor, checksums, commit) takes far longer than a step's compute leaves
idle. Copying into private host buffers is a plain memcpy on the training thread; everything after it runs
in the save's background thread while training goes on. Accelerator tensors go through page-locked
(pinned) buffers, copied on a side stream (`non_blocking`: DMA, no pageable bounce), one event per tensor,
so the background thread writes the first tensors to the store while later ones are still being copied;
the training stream waits for the copies on the device, not on the host, before it changes the tensors.

Buffers are kept per (name, shape, dtype, pinned) and reused by the next snapshot of the same layout (no
allocation, no page faults, no pinning per snapshot); buffers of a layout the job left are freed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .shards import as_numpy, host_resident

Key = tuple[str, tuple[int, ...], torch.dtype, bool]


class StagingPool:
    """Reusable host buffers; a buffer belongs to at most one snapshot in flight."""

    def __init__(self) -> None:
        self._free: dict[Key, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made so far (tests check that snapshots reuse them)

    def take(self, key: Key) -> torch.Tensor:
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
            self.allocated += 1
        _, shape, dtype, pinned = key
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)

    def give_back(self, buffers: dict[Key, torch.Tensor], current: set[Key]) -> None:
        """Return a finished snapshot's buffers; free those of keys no longer saved (another layout)."""
        with self._lock:
            for key, buf in buffers.items():
                if key in current:
                    self._free.setdefault(key, []).append(buf)
            for key in [k for k in self._free if k not in current]:
                del self._free[key]

    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for bufs in self._free.values() for b in bufs)


POOL = StagingPool()


@dataclass(eq=False)
class StagedSnapshot:
    """One save's host copies of its shards; `array(name)` waits for that tensor's copy only."""

    pool: StagingPool
    arrays_: dict[str, np.ndarray] = field(default_factory=dict)
    events: dict[str, Any] = field(default_factory=dict)  # name -> torch.cuda.Event of its copy
    buffers: dict[Key, torch.Tensor] = field(default_factory=dict)

    def array(self, name: str) -> np.ndarray:
        event = self.events.pop(name, None)
        if event is not None:
            event.synchronize()
        return self.arrays_[name]

    def release(self) -> None:
        """The store holds the bytes now: the buffers go back to the pool."""
        for event in self.events.values():  # a failed save: let pending copies land before reuse
            event.synchronize()
        self.events.clear()
        self.arrays_.clear()
        self.pool.give_back(self.buffers, set(self.buffers))
        self.buffers = {}


def stage(tensors: dict[str, torch.Tensor], copy_cpu: bool, pool: StagingPool = POOL) -> StagedSnapshot:
    """Host arrays of `tensors` (local shards): accelerator tensors always copied into pinned buffers
    (asynchronously, on a side stream), CPU tensors copied into buffers when `copy_cpu` (an asynchronous
    save: the caller changes them next step), else viewed in place when contiguous."""
    snap = StagedSnapshot(pool)
    sides: dict[torch.device, Any] = {}  # a side stream per device
    for name, t in tensors.items():
        t = t.detach()
        if host_resident(t) and not copy_cpu:
            snap.arrays_[name] = as_numpy(t)
            continue
        key: Key = (name, tuple(t.shape), t.dtype, t.device.type == "cuda")
        buf = pool.take(key)
        snap.buffers[key] = buf
        if t.device.type == "cuda":
            side = sides.get(t.device)
            if side is None:
                side = sides[t.device] = torch.cuda.Stream(device=t.device)
                side.wait_stream(torch.cuda.current_stream(t.device))  # the step's last kernels first
            with torch.cuda.stream(side):
                buf.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            t.record_stream(side)  # the caller may drop `t`: its memory stays until the copy is done
            snap.events[name] = event
        else:
            buf.copy_(t)
        snap.arrays_[name] = as_numpy(buf)
    for device, side in sides.items():  # the next step's kernels change the tensors only after their copies
        torch.cuda.current_stream(device).wait_stream(side)
    return snap
