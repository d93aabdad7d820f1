"""The store's own memory: a private huge-page tmpfs, and memory reserved (pre-faulted) at start.

Why: on `/dev/shm` (4 KiB pages, no transparent huge pages for shared memory on most distributions) a
blob's first write pays page allocation and a fault per 4 KiB page in the daemon and again in the client,
far below the speed of a copy. A tmpfs mounted with `huge=within_size` backs every blob's 2 MiB-aligned
part with huge pages: mapping is far cheaper, copies into it run at memory speed, and small blobs still
take 4 KiB pages (no 2 MiB of memory per bias vector). Measured by `python benchmarks/bench_store.py`: the
"shm first write" rows, /dev/shm against the huge-page tmpfs, in results/bench_store.json.

The tmpfs is mounted in a mount namespace of the daemon's own (`unshare(CLONE_NEWNS)`), on the same
`/dev/shm/tenplex-<tag>-<pid>` directory the plain arena uses, which stays empty from outside. Other
processes of this host open blob files through `/proc/<daemon pid>/root/...`, which resolves in the
daemon's namespace. So the mount cannot outlive the daemon: a SIGKILLed store's namespace goes with it and
the kernel frees the memory once no client maps a file; what is left is the empty directory, which
`StoreProcess` or the next start removes. Mounting needs root (CAP_SYS_ADMIN); elsewhere the store falls
back to a plain directory on `/dev/shm` with a one-line notice.

Fresh huge pages are slow to get the first time (the kernel compacts memory; the same rows, with and
without `--reserve`), so `--reserve SIZE` takes that much at start in a file of its own, whose ranges then
hold blobs (`slab`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import re
import shutil
import threading
from dataclasses import dataclass

from ..util import logs

log = logs.get("store.tmpfs")

HUGE_PAGE = 2 << 20
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


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, loaded once (`find_library` runs `ldconfig`)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_private(mountpoint: str, size: int) -> None:
    """Mount a huge-page tmpfs on `mountpoint` in a new mount namespace of the calling (main) thread.

    The namespace belongs to that thread and to the threads it starts afterwards, so the daemon calls this
    before it serves anything. A second call makes another namespace (a copy of the first): harmless."""
    c = libc()
    _check(c.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    # mounts made here must not propagate back to the host's namespace
    _check(c.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    opts = f"huge=within_size,size={size},mode=0700".encode()
    _check(c.mount(b"tenplex", mountpoint.encode(), b"tmpfs", 0, opts), f"mount tmpfs on {mountpoint}")


def _umount(mountpoint: str) -> None:
    c = libc()
    if c.umount2(mountpoint.encode(), _MNT_DETACH) != 0:
        log.debug("umount %s: %s", mountpoint, os.strerror(ctypes.get_errno()))
