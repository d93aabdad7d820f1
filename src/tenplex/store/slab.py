"""The memory a store takes at start (`--reserve`): one pre-faulted file whose page-aligned ranges hold
blobs, handed out and taken back without a system call.

Why: a blob in a file of its own costs a file, an allocation and fresh pages the first time its size is
seen. Fresh pages are zeroed by the kernel on first touch and, on a virtual machine, may first have to come
back from the host, and every small blob costs system calls. In the reference pp change (two ranks saving
1.2 GB in about 300 blobs into one store) the first save's copy phase, which includes the allocation, takes
far longer than the second save's into recycled files; with ranges both take as long as the second
(`save_phases_first` against `save_phases` in results/bench_reconfig.json, from
`python benchmarks/bench_reconfig.py --pairs pp --hosts 1 --no-dcp`). Ranges of one file touched at start
cost neither: taking one is a list operation and its pages are backed already.

A range's content is undefined when it is handed out (like np.empty). A freed range goes back to the free
list (merged with its neighbours) only when no request holds its blob (the catalog counts them); a range a
client may still write through (an unsealed blob of an abandoned writer) is retired instead: its pages are
given back to the kernel and the offsets are never handed out again. Pages given back to make room
(`punch`) leave holes that are never handed out again either, so every range handed out is backed.

A *pack* (`sparse=True`) is the same allocator over a sparse file that holds small blobs (see
`arena.Arena`): its ranges start as holes and are backed when handed out (`MADV_POPULATE_WRITE` on the
daemon's mapping, 4 KiB pages: a pack is mapped `MADV_NOHUGEPAGE`, so a 100-byte blob never takes a huge
page); pages given back to make room become holes again, handed out again later (backed anew: zeros).
Retired ranges are never handed out again here either.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import threading

from .tmpfs import HUGE_PAGE, libc, round_up

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_POPULATE_WRITE = 23  # madvise(2) MADV_POPULATE_WRITE
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE

Ranges = list[tuple[int, int]]  # (offset, length), sorted, never adjacent


class Slab:
    """Free ranges of one file, kept sorted by offset; all methods are thread-safe."""

    NAME = "reserve"

    def __init__(
        self, directory: str, nbytes: int, huge: bool, name: str = NAME, sparse: bool = False
    ) -> None:
        self.path = os.path.join(directory, name)
        self.size = 0
        self.left = 0  # backed bytes in free ranges
        self.taken = 0  # bytes in ranges handed out and neither given back nor retired
        self.huge = huge and not sparse
        self.sparse = sparse
        self.mem: mmap.mmap | None = None
        self._fd = -1  # kept open for punching holes
        self._free: Ranges = []  # backed
        self._holes: Ranges = []  # not backed; handed out (and backed then) only in a pack
        self._lock = threading.Lock()
        if nbytes <= 0:
            return
        nbytes = round_up(nbytes, mmap.PAGESIZE if sparse else HUGE_PAGE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if sparse:
                self.mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
                self.mem.madvise(mmap.MADV_NOHUGEPAGE)
            else:
                os.posix_fallocate(fd, 0, nbytes)
                # tmpfs hands out fallocated pages unzeroed and zeroes them at the first fault: that first
                # touch is what costs (`save_phases_first` in results/bench_reconfig.json)
                self.mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd
        self.size = nbytes
        if sparse:
            self._holes = [(0, nbytes)]
        else:
            self.left, self._free = nbytes, [(0, nbytes)]

    def align(self, nbytes: int) -> int:
        """Where a range of `nbytes` may start: whole huge pages start on a huge page (mapped by one
        page-table entry each), the rest on a page."""
        return HUGE_PAGE if self.huge and nbytes >= HUGE_PAGE else mmap.PAGESIZE

    def take(self, nbytes: int, holes: bool = True) -> int | None:
        """The offset of a free range of `nbytes` (a multiple of the page size), out of the free list: the
        smallest backed free range it fits in, else (a pack, `holes`) the smallest hole, backed now; None
        when none has room. OSError(ENOSPC) when the file system has no room for a hole's pages."""
        if nbytes <= 0:
            return None
        step = self.align(nbytes)
        with self._lock:
            start = _cut(self._free, nbytes, step)
            hole = start is None and self.sparse and holes
            if hole:
                start = _cut(self._holes, nbytes, step)
            if start is None:
                return None
            self.left -= 0 if hole else nbytes
            self.taken += nbytes
        if hole:
            self._back(start, nbytes)
        return start

    def _back(self, offset: int, nbytes: int) -> None:
        """Back a range taken from the holes; when the file system is full the range is a hole again and
        OSError(ENOSPC) is raised (a fault on it would have been SIGBUS)."""
        assert self.mem is not None
        try:
            self.mem.madvise(_POPULATE_WRITE, offset, nbytes)
            return
        except OSError:  # EFAULT: no room for the pages
            pass
        self._punch(offset, nbytes)
        with self._lock:
            _insert(self._holes, offset, nbytes)
            self.taken -= nbytes
        raise OSError(errno.ENOSPC, f"no room for {nbytes} bytes in {self.path}")

    def give(self, offset: int, nbytes: int) -> None:
        """A range handed out by `take` is free again, its pages kept for the next blob."""
        with self._lock:
            _insert(self._free, offset, nbytes)
            self.left += nbytes
            self.taken -= nbytes

    def retire(self, offset: int, nbytes: int) -> None:
        """A range handed out by `take` that must never be handed out again: its pages go back to the
        kernel now (a writer that still writes through it only fills a hole nobody reads)."""
        with self._lock:
            self.taken -= nbytes
        self._punch(offset, nbytes)

    def punch(self, nbytes: int) -> int:
        """Give at least `nbytes` (at most all) of the free ranges' pages back to the kernel, cut from the
        ends of the largest ranges in whole huge pages (pages without them); the bytes given back. Why: the
        store's memory limit counts free ranges, and a blob that fits no free range takes the pages given
        back here for a file of its own; what is not needed stays free. In a pack the cut becomes a hole."""
        unit = self.align(HUGE_PAGE)
        out = []
        with self._lock:
            need = nbytes
            while self._free and need > 0:
                i = max(range(len(self._free)), key=lambda j: self._free[j][1])
                at, n = self._free[i]
                cut = min(n, round_up(need, unit))
                if cut < n:
                    self._free[i] = (at, n - cut)
                else:
                    del self._free[i]
                out.append((at + n - cut, cut))
                need -= cut
            given = sum(n for _, n in out)
            self.left -= given
        for at, n in out:
            self._punch(at, n)
            if self.sparse:
                with self._lock:
                    _insert(self._holes, at, n)
        return given

    def _punch(self, offset: int, nbytes: int) -> None:
        """Free the pages of a range (fallocate PUNCH_HOLE), even where a process maps them."""
        if libc().fallocate(self._fd, _PUNCH, ctypes.c_long(offset), ctypes.c_long(nbytes)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"punching a hole in {self.path}: {os.strerror(err)}")

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The daemon's writable view of a range."""
        assert self.mem is not None
        return memoryview(self.mem)[offset : offset + nbytes]

    def holds(self, path: str) -> bool:
        return self.size > 0 and path == self.path

    def release(self) -> None:
        """Give all of it back (the store is closing, or a pack is empty): its pages go now, even where a
        client still maps the file (a stale writer's mapping only fills a hole of an unlinked file)."""
        with self._lock:
            self._free.clear()
            self._holes.clear()
            self.left = 0
            if self._fd >= 0:
                self._punch(0, self.size)
            if self.mem is not None:
                try:
                    self.mem.close()
                except BufferError:  # a view outlives the store's blobs: the pages go with the last one
                    pass
                self.mem = None
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass


def _cut(ranges: Ranges, nbytes: int, step: int) -> int | None:
    """Take `nbytes` starting on a multiple of `step` out of the smallest of `ranges` it fits in (what is
    left of that range stays in the list); its start, or None."""
    best = None
    for i, (at, n) in enumerate(ranges):
        if round_up(at, step) + nbytes <= at + n and (best is None or n < ranges[best][1]):
            best = i
    if best is None:
        return None
    at, n = ranges.pop(best)
    start = round_up(at, step)
    rest = [(a, b) for a, b in ((at, start - at), (start + nbytes, at + n - start - nbytes)) if b]
    ranges[best:best] = rest
    return start


def _insert(ranges: Ranges, offset: int, nbytes: int) -> None:
    """Put a range into `ranges`, merged with its neighbours."""
    i = bisect.bisect_left(ranges, (offset, 0))
    assert (i == 0 or sum(ranges[i - 1]) <= offset) and (
        i == len(ranges) or offset + nbytes <= ranges[i][0]
    ), "a range given back twice"
    if i < len(ranges) and offset + nbytes == ranges[i][0]:
        nbytes += ranges.pop(i)[1]
    if i > 0 and sum(ranges[i - 1]) == offset:
        i -= 1
        offset, nbytes = ranges[i][0], ranges.pop(i)[1] + nbytes
    ranges.insert(i, (offset, nbytes))
