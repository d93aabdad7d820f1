"""The store's own memory: a private huge-page tmpfs, and memory reserved (pre-faulted) at start.

Why: on `/dev/shm` (4 KiB pages, no transparent huge pages for shared memory on most distributions) a
blob's first write pays page allocation and a fault per 4 KiB page in the daemon and again in the client,
~1.2-1.7 GB/s against ~13 GB/s for a copy. A tmpfs mounted with `huge=within_size` backs every blob's
2 MiB-aligned part with huge pages: mapping takes 0.2 ms instead of ~28 ms per 256 MiB, copies into it run
at memory speed, and small blobs still take 4 KiB pages (no 2 MiB of memory per bias vector).

The tmpfs is mounted in a mount namespace of the daemon's own (`unshare(CLONE_NEWNS)`), on the same
`/dev/shm/tenplex-<tag>-<pid>` directory the plain arena uses, which stays empty from outside. Other
processes of this host open blob files through `/proc/<daemon pid>/root/...`, which resolves in the
daemon's namespace. So the mount cannot outlive the daemon: a SIGKILLed store's namespace goes with it and
the kernel frees the memory once no client maps a file; what is left is the empty directory, which
`StoreProcess` or the next start removes. Mounting needs root (CAP_SYS_ADMIN); elsewhere the store falls
back to a plain directory on `/dev/shm` with a one-line notice.

Fresh huge pages are slow to get the first time (the kernel compacts memory: ~0.45 GB/s measured here), so
`--reserve SIZE` takes that much at start in a file of its own; each new blob file then takes its pages
from the reserve (the reserve shrinks by the blob's size, rounded to huge pages, just before the blob file
is allocated, and the kernel hands the freed pages straight back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re
import shutil
import threading
from dataclasses import dataclass

from ..util import logs

log = logs.get("store.tmpfs")

HUGE_PAGE = 2 << 20
_TOUCH = 256 << 20  # bytes of the reserve touched per mapping
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
_MNT_DETACH = 2
_PROC_ROOT = re.compile(r"^/proc/\d+/root(?=/)")


def round_up(n: int, to: int = HUGE_PAGE) -> int:
    return -(-n // to) * to


def host_path(path: str) -> str:
    """The path of a store's directory in the shared file system: `/proc/PID/root/X` -> `X` (the empty
    mountpoint a huge-page store leaves behind when killed); other paths unchanged."""
    return _PROC_ROOT.sub("", path)


@dataclass
class StoreMemory:
    """Where a store keeps its blob files."""

    dir: str  # the directory every process of this host opens blob files in
    mountpoint: str  # the directory in the shared file system (== dir without huge pages)
    huge: bool  # a private huge-page tmpfs of `size` bytes; False: a plain directory on /dev/shm
    notice: str = ""  # why there are no huge pages, in one line

    def close(self) -> None:
        """Remove every file, unmount, remove the directory (idempotent)."""
        if self.huge:
            shutil.rmtree(self.mountpoint, ignore_errors=True)  # our namespace sees the tmpfs here
            _umount(self.mountpoint)
        shutil.rmtree(self.mountpoint, ignore_errors=True)


def open_memory(root: str, name: str, size: int, huge: str = "auto") -> StoreMemory:
    """Make the store's directory `root/name` (mode 0700) and, unless `huge` is "off", mount a private
    huge-page tmpfs of `size` bytes (at most the size of `root`'s file system) on it. `huge="on"` raises
    OSError when that is impossible; "auto" falls back to the plain directory and says why in `notice`."""
    if huge not in ("auto", "on", "off"):
        raise ValueError(f"huge pages must be auto, on or off, not {huge!r}")
    mountpoint = os.path.join(os.path.realpath(root), name)
    os.makedirs(mountpoint, mode=0o700)
    if huge == "off":
        return StoreMemory(mountpoint, mountpoint, False, "huge pages off (--huge-pages off)")
    st = os.statvfs(mountpoint)
    size = min(size, st.f_blocks * st.f_frsize)  # the limit stays capped by the size of /dev/shm
    try:
        if threading.current_thread() is not threading.main_thread():
            # /proc/PID/root resolves in the main thread's namespace: only it can own the mount
            raise OSError(0, "the store is not its process's main thread")
        _mount_private(mountpoint, round_up(max(size, HUGE_PAGE)))
    except OSError as e:
        if huge == "on":
            shutil.rmtree(mountpoint, ignore_errors=True)
            raise
        return StoreMemory(mountpoint, mountpoint, False, f"no huge-page tmpfs ({e.strerror or e}): {root}")
    return StoreMemory(f"/proc/{os.getpid()}/root{mountpoint}", mountpoint, True)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_private(mountpoint: str, size: int) -> None:
    """Mount a huge-page tmpfs on `mountpoint` in a new mount namespace of the calling (main) thread.

    The namespace belongs to that thread and to the threads it starts afterwards, so the daemon calls this
    before it serves anything. A second call makes another namespace (a copy of the first): harmless."""
    libc = _libc()
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # mounts made here must not propagate back to the host's namespace
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    opts = f"huge=within_size,size={size},mode=0700".encode()
    _check(libc.mount(b"tenplex", mountpoint.encode(), b"tmpfs", 0, opts), f"mount tmpfs on {mountpoint}")


def _umount(mountpoint: str) -> None:
    libc = _libc()
    if libc.umount2(mountpoint.encode(), _MNT_DETACH) != 0:
        log.debug("umount %s: %s", mountpoint, os.strerror(ctypes.get_errno()))


class Reserve:
    """Memory a store takes at start so that no save pays for fresh pages: one file, allocated with
    `posix_fallocate` and touched once (tmpfs hands out fallocated pages unzeroed and zeroes them at the
    first fault; on a virtual machine that first touch of memory is what costs: 256 MiB of huge pages
    took 0.84 s to fault the first time here, 0.2 ms the second), shrunk from its end by each `take`."""

    NAME = "reserve"

    def __init__(self, directory: str, nbytes: int) -> None:
        self.path = os.path.join(directory, self.NAME)
        self.left = 0
        self._lock = threading.Lock()
        if nbytes <= 0:
            return
        nbytes = round_up(nbytes)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            for at in range(0, nbytes, _TOUCH):  # in windows: page tables for a window at a time
                n = min(_TOUCH, nbytes - at)
                mmap.mmap(fd, n, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ, offset=at).close()
        except OSError:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.left = nbytes

    def take(self, nbytes: int) -> bool:
        """Give back `nbytes` (rounded up to huge pages) of the reserve for a new blob file that is
        allocated right after; False (nothing changed) when the reserve holds less."""
        need = round_up(nbytes)
        with self._lock:
            if need == 0 or need > self.left:
                return False
            self._shrink(need)
        return True

    def trim(self, nbytes: int) -> None:
        """Give at least `nbytes` (at most all) of the reserve back to the kernel: the store's memory
        limit counts the reserve, and blobs recycling pooled files do not consume it."""
        with self._lock:
            if nbytes > 0 and self.left:
                self._shrink(min(self.left, round_up(nbytes)))

    def _shrink(self, n: int) -> None:
        self.left -= n
        if self.left:
            os.truncate(self.path, self.left)
        else:
            os.unlink(self.path)

    def release(self) -> None:
        """Give all of the reserve back (the store is closing)."""
        with self._lock:
            if self.left:
                self.left = 0
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
