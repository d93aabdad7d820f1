"""The daemon's blob memory (`Arena`): ranges of the reserve and of shared pack files for small blobs,
files of their own for large ones, all recycled when freed, in the store's directory of `shm`.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .errors import MemoryLimitError, StoreError
from .shm import map_file, pages, reap, shm_root
from .slab import Slab
from .tmpfs import StoreMemory, open_memory, round_up

MAX_FILES = 4096  # blob files of their own at most: a blob smaller than limit / MAX_FILES goes to a pack
PACK_MIN = 1 << 20  # blobs below this always go to a pack, whatever the limit
PACK_SPAN = 1 << 30  # the size of a pack file (sparse: only its ranges in use take memory)


@dataclass(frozen=True)
class Place:
    """Where a blob's bytes live: `span` bytes of the file at `path` are what a client maps, the blob is
    at `offset` in them; `mem` is the daemon's writable view of exactly the blob."""

    path: str
    mem: mmap.mmap | bytearray | memoryview
    offset: int
    span: int


class Arena:
    """The daemon's blob memory: ranges of the slab taken at start (`--reserve`, see `slab`), else ranges of
    pack files for small blobs, else files created on demand; all recycled when freed, the directory
    removed on exit.

    Why packs: a file per blob costs the daemon a descriptor and a mapping per blob (the kernel allows
    65,530 mappings; a save of 70,000 one-element tensors ran out of both), and a client a mapping per
    blob. A blob below `pack_max` (the memory limit / MAX_FILES, at least PACK_MIN) is a page-aligned range
    of a pack file (`Slab(sparse=True)`), so blob files of their own number at most MAX_FILES, packs about
    one per PACK_SPAN of small blobs, and a client maps each file once whatever the blobs in it.

    A new tmpfs file costs page allocation, far slower than a memory copy (`python benchmarks/bench_store.py`:
    the "shm first write" rows against "shm write 256 MiB, recycled file" in results/bench_store.json), so
    freed files are kept for a while and handed to the next blob of the same size, and freed pack ranges
    keep their pages: periodic snapshots of one job have the same shapes every time, and their writes then
    run at memory-copy speed. Both count as `pooled` in the memory limit and give their pages back when
    room is needed.

    Never foreign bytes: the catalog recycles a range or a file only once no request holds its blob any
    more (reference counts), so a reuse can never overwrite bytes that are being served; and the memory
    of a blob a writer may still write through (unsealed, `discard`) is never handed out again (a file is
    unlinked, a range retired: its pages punched and its offsets out of use), so a new blob never sees a
    stale writer's bytes.
    """

    TTL = 120.0  # pooled files unused this long are unlinked

    def __init__(
        self, tag: str, root: str | None = None, huge: str = "off", size: int = 0, reserve: int = 0
    ) -> None:
        """`huge`, `size`: a private huge-page tmpfs of that size (see `tmpfs`); `reserve`: bytes taken at
        start for the first blobs' pages."""
        reap(root)  # leftovers of stores killed before they could clean up
        try:
            name = f"tenplex-{tag}-{os.getpid()}"
            self.memory: StoreMemory = open_memory(root or shm_root(), name, size, huge)
        except OSError as e:
            raise StoreError(f"cannot make the store's memory directory: {e}") from None
        self.dir = self.memory.dir
        try:
            self.reserve = Slab(self.dir, reserve, self.memory.huge)
        except OSError as e:
            self.memory.close()
            raise MemoryLimitError(f"cannot reserve {reserve} bytes in {self.dir}: {e.strerror}") from None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[float, str, mmap.mmap | bytearray]]] = {}  # per size, oldest first
        self._order: OrderedDict[str, int] = OrderedDict()  # every pooled file, oldest first -> its size
        self.pooled_files = 0
        # `size`: the limit; a pack holds its blobs whole, so none may be larger than a pack
        self.pack_max = min(PACK_SPAN, max(PACK_MIN, round_up(size // MAX_FILES, mmap.PAGESIZE)))
        self.packs: dict[str, Slab] = {}
        self._pack_lock = threading.RLock()

    @property
    def pooled(self) -> int:
        """Freed memory kept for reuse: pooled files and free ranges of packs."""
        return self.pooled_files + sum(p.left for p in list(self.packs.values()))

    def footprint(self, nbytes: int) -> int:
        """The bytes a blob of `nbytes` takes in memory: its file's size, in whole pages.

        Why a huge-page store rounds a large blob up to whole huge pages: tmpfs backs the part of a file
        not covering a whole huge page with 4 KiB pages, and on a virtual machine those come fresh from the
        host, slowly, while huge pages freed a moment before are still backed (`python
        benchmarks/bench_store.py`: the "shm first write" rows in results/bench_store.json). The rounding is
        done only where it wastes at most an eighth of the blob, so small blobs keep 4 KiB pages."""
        whole = round_up(nbytes)
        if self.memory.huge and whole - nbytes <= nbytes // 8:
            return whole
        return pages(nbytes)

    def create(self, nbytes: int) -> Place:
        """Memory for a blob of `nbytes`, its pages taken already where possible: a free range of the
        slab; else a recycled file of that size; else the smallest larger pooled file, cut to size; else a
        new file on the pages of free slab ranges and of the oldest smaller pooled files, freed for it.
        It takes `footprint(nbytes)`; its content is undefined (like np.empty)."""
        if nbytes == 0:  # no memory, no file: nothing maps it
            return Place(os.path.join(self.dir, "empty"), bytearray(), 0, 0)
        size = self.footprint(nbytes)
        at = self.reserve.take(size)
        if at is not None:
            return Place(self.reserve.path, self.reserve.view(at, nbytes), at, self.reserve.size)
        if size < self.pack_max:
            return self._packed(size, nbytes)
        with self._lock:
            if self._free.get(nbytes):
                path, mem = self._unpool(nbytes)
                return Place(path, mem, 0, nbytes)
            larger = self._smallest_above(nbytes)
            if larger is not None:
                path, mem = self._unpool(larger)
            else:
                path = os.path.join(self.dir, f"b{next(self._ids):08d}")
                given = self.reserve.punch(size)  # the pages it gives back go to the new file
                smaller = self._take_oldest(size - given)
        if larger is not None:
            return Place(path, self._cut(path, mem, nbytes), 0, nbytes)
        for p, m in smaller:  # freed right before the new file is made
            self._retire(p, m)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._allocate(fd, size)
        except OSError as e:
            os.close(fd)
            self.remove(path)
            raise self._no_room(nbytes, e) from None
        os.close(fd)
        return Place(path, map_file(path, nbytes, writable=True), 0, nbytes)

    def _packed(self, size: int, nbytes: int) -> Place:
        """A range of a pack for a small blob: a free range of a pack, else a hole of one (backed now),
        else a new pack. When the file system is full below the limit, the pool gives way first."""
        with self._pack_lock:
            try:
                return self._pack_range(size, nbytes)
            except OSError as e:
                if e.errno != errno.ENOSPC or not self.pooled:
                    raise self._no_room(nbytes, e) from None
            self.trim(0)
            try:
                return self._pack_range(size, nbytes)
            except OSError as e:
                raise self._no_room(nbytes, e) from None

    def _no_room(self, nbytes: int, e: OSError) -> MemoryLimitError:
        return MemoryLimitError(f"no room for {nbytes} bytes in {self.dir}: {e.strerror} ({self._usage()})")

    def _pack_range(self, size: int, nbytes: int) -> Place:
        """A pack range of `size` bytes: pages already backed in any pack first, then holes, then a new pack
        (the caller holds the lock)."""
        for holes in (False, True):
            for pack in self.packs.values():
                at = pack.take(size, holes)
                if at is not None:
                    return Place(pack.path, pack.view(at, nbytes), at, pack.size)
        pack = Slab(self.dir, PACK_SPAN, False, f"p{next(self._ids):08d}", sparse=True)
        self.packs[pack.path] = pack
        at = pack.take(size)
        assert at is not None
        return Place(pack.path, pack.view(at, nbytes), at, pack.size)

    def _drop_empty_packs(self) -> None:
        """Remove packs that hold no blob and no pages (their pages were given back to make room): clients
        drop their mappings of a removed file (`mappings.Mappings.sweep`)."""
        with self._pack_lock:
            empty = [p for p in self.packs.values() if p.taken == 0 and p.left == 0]
            for p in empty:
                del self.packs[p.path]
        for p in empty:
            p.release()

    def _smallest_above(self, nbytes: int) -> int | None:
        """The smallest pooled size above `nbytes` (the caller holds the lock).

        Why: after a reconfiguration every blob has a new size, so no pooled file fits exactly, and on a
        virtual machine fresh pages are what a save pays for (its first touch of freed memory runs far below
        a copy into pages already taken: `python benchmarks/bench_store.py`, "shm write, a new size after a
        layout change (pooled file cut)" in results/bench_store.json). A larger pooled file cut to
        size keeps its pages for the new blob."""
        sizes = [n for n, files in self._free.items() if files and n > nbytes]
        return min(sizes) if sizes else None

    def _take_oldest(self, nbytes: int) -> list[tuple[str, mmap.mmap | bytearray]]:
        """Pooled files, oldest first, until they hold `nbytes` of pages (or all of them), out of the pool
        (the caller holds the lock, and retires them).

        Why: a blob larger than every pooled file (a layout with fewer, bigger shards) would otherwise take
        fresh pages while the smaller files of the old layout sit unused; the pages a file frees right
        before the new one is allocated are the ones it gets, already backed (on a virtual machine, memory
        freed for a few seconds may go back to the host, and its first touch then costs far more than a
        copy: `save_phases_first` in results/bench_reconfig.json). Nobody maps a pooled file for reading
        and its name is never handed out again."""
        taken: list[tuple[str, mmap.mmap | bytearray]] = []
        while self._order and nbytes > 0:
            n = next(iter(self._order.values()))  # the oldest file overall is the oldest of its size
            taken.append(self._unpool(n))
            nbytes -= self.footprint(n)
        return taken

    def _unpool(self, nbytes: int) -> tuple[str, mmap.mmap | bytearray]:
        """The oldest pooled file of `nbytes`, out of the pool (the caller holds the lock)."""
        _, path, mem = self._free[nbytes].pop(0)
        del self._order[path]
        self.pooled_files -= self.footprint(nbytes)
        return path, mem

    def _cut(self, path: str, mem: mmap.mmap | bytearray, nbytes: int) -> mmap.mmap | bytearray:
        """A pooled file truncated to `nbytes` (its tail freed), mapped afresh. Nobody maps a pooled file
        but the daemon and clients' caches, which are keyed by size as well: a mapping of the old size is
        never handed out for the new blob."""
        if isinstance(mem, mmap.mmap):
            try:
                mem.close()
            except BufferError:  # a view of it outlives the blob (harmless: the same file, never read)
                pass
        os.truncate(path, self.footprint(nbytes))
        return map_file(path, nbytes, writable=True)

    def _allocate(self, fd: int, nbytes: int) -> None:
        """Take the file's pages now (ENOSPC here instead of SIGBUS on a write into the mapping). The pool
        and the reserve are memory kept for speed only: when the file system is full below the limit (a
        client still maps a discarded file, huge-page rounding), they give way first."""
        if not nbytes:
            return
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno != errno.ENOSPC or not (self.pooled or self.reserve.left):
                raise
            self.trim(0)
            os.posix_fallocate(fd, 0, nbytes)

    def _usage(self) -> str:
        """Where the file system's space went, for an error that says why it is full."""
        st = os.statvfs(self.dir)
        files = 0
        with os.scandir(self.dir) as it:
            for e in it:
                files += e.stat().st_blocks * 512
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return (
            f"file system {used} of {st.f_blocks * st.f_frsize} bytes used, {files} in files, pooled "
            f"{self.pooled} ({len(self.packs)} packs), reserve {self.reserve.left}"
        )

    def _slab(self, path: str) -> Slab | None:
        """The reserve or the pack a blob at `path` is a range of; None for a file of its own."""
        return self.reserve if self.reserve.holds(path) else self.packs.get(path)

    def recycle(self, place: Place, nbytes: int) -> None:
        """Keep a freed blob's memory for reuse: its reserve or pack range for any blob that fits, its file
        for one of the same size."""
        if not nbytes:  # an empty blob has no memory
            return
        slab = self._slab(place.path)
        if slab is not None:
            slab.give(place.offset, self.footprint(nbytes))
            return
        with self._lock:
            self._free.setdefault(nbytes, []).append((time.monotonic(), place.path, place.mem))
            self._order[place.path] = nbytes
            self.pooled_files += self.footprint(nbytes)
        self.trim(None)

    def trim(self, keep: int | None) -> None:
        """Unlink pooled files older than TTL, then the oldest ones until at most `keep` bytes are pooled
        (the reserve and free pack ranges count as pooled, and go first: a pooled file of a known size is
        worth more than a free range)."""
        now = time.monotonic()
        if keep is not None:
            over = self.pooled + self.reserve.left - keep
            for slab in (self.reserve, *list(self.packs.values())):
                over -= slab.punch(over) if over > 0 else 0
            self._drop_empty_packs()
            keep -= self.pooled - self.pooled_files + self.reserve.left
        doomed = []
        with self._lock:  # from the oldest file on, and only as far as there is something to unlink
            while self._order:
                path, n = next(iter(self._order.items()))
                t, first, _ = self._free[n][0]  # the oldest file overall is the oldest of its size
                assert first == path
                if not (now - t > self.TTL or (keep is not None and self.pooled_files > keep)):
                    break
                doomed.append(self._unpool(n))
        for p, mem in doomed:
            self._retire(p, mem)

    def _retire(self, path: str, mem: mmap.mmap | bytearray) -> None:
        """Free a pooled file's pages now, then unlink it. tmpfs frees an unlinked file's pages only at its
        last unmap, and clients cache mappings of the files they read and wrote (`mappings`): without the
        truncate, the store ran out of room below its memory limit (ENOSPC). Truncating is safe because
        nobody reads or writes a pooled file (its blob is gone and no request held it) and its name is
        never handed out again, so no cached mapping of it is ever touched."""
        try:
            os.truncate(path, 0)
        except OSError:
            pass
        if isinstance(mem, mmap.mmap):
            try:
                mem.close()
            except BufferError:
                pass
        self.remove(path)

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def discard(self, place: Place, nbytes: int) -> None:
        """Free a blob's memory without reusing it: a client may still write through its own mapping of it
        (an unsealed blob of an abandoned writer), so it must never be handed to another blob. A file is
        unlinked, a reserve or pack range's pages are given back and its offsets retired."""
        if not nbytes:  # an empty blob has no memory
            return
        slab = self._slab(place.path)
        if slab is not None:
            slab.retire(place.offset, self.footprint(nbytes))
            self._drop_empty_packs()
            return
        self.remove(place.path)
        if isinstance(place.mem, mmap.mmap):
            try:
                place.mem.close()
            except BufferError:
                pass

    def capacity(self) -> int:
        """Bytes the shared-memory file system can hold in total (the ceiling of any memory limit)."""
        st = os.statvfs(self.dir)
        return st.f_blocks * st.f_frsize

    def close(self) -> None:
        with self._lock:
            self._free.clear()
            self._order.clear()
            self.pooled_files = 0
        with self._pack_lock:
            packs, self.packs = list(self.packs.values()), {}
        for p in packs:
            p.release()
        self.reserve.release()
        self.memory.close()
