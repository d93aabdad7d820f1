"""Shared memory as files: where a store's private directory lives (/dev/shm, or the store's own huge-page
tmpfs mounted there, see `tmpfs`), how its files are mapped and pre-faulted, which machine shares them,
and the removal of the directories of stores that died. What goes in the files is `arena`'s.

Files on tmpfs plus mmap (rather than `multiprocessing.shared_memory`) because the daemon alone decides
when a segment goes away: no resource tracker in a client process can unlink it when that client exits.
File names are generated (`b00000001`), never derived from job or blob names.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import shutil
import socket
import stat
import tempfile

from .errors import AuthError
from .protocol import trusted_uid

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_POPULATE_READ, _POPULATE_WRITE = 22, 23  # madvise(2) advice values
_ARENA = re.compile(r"tenplex-(\d+)-(\d+)")  # tenplex-PORT-PID, what Arena names its directory
log = logging.getLogger("tenplex.store")


def pages(nbytes: int) -> int:
    """The memory a file of `nbytes` takes on tmpfs: whole pages (a store of many small blobs otherwise
    filled its file system while its accounting said there was room)."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def shm_root() -> str:
    """Where blob files live: /dev/shm when it exists (memory), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def host_id() -> str:
    """Identifies this machine (and boot): a store with the same id can share memory with us."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def map_file(path: str, nbytes: int, writable: bool, populate: bool = True) -> mmap.mmap | bytearray:
    """Map a blob file; pages are pre-faulted (MAP_POPULATE) because faulting 4 KiB at a time would stall
    the copy at every page (the "shm first write ... 4 KiB pages" row of `python benchmarks/bench_store.py`
    in results/bench_store.json; a slab is mapped whole and only its blobs' ranges populated, see `populate`).
    Empty blobs have no mapping. Only a regular file of this user or root is mapped, never through a
    symlink: a client maps what a store told it, and the store must not be able to point it elsewhere."""
    if nbytes == 0:
        return bytearray()
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AuthError(f"{path} is a symlink: not mapped") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not trusted_uid(st.st_uid):
            raise AuthError(f"{path} is not a regular file of this user or root: not mapped")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0), prot=prot)
    finally:
        os.close(fd)


def populate(mem: mmap.mmap, offset: int, nbytes: int, writable: bool) -> None:
    """Pre-fault a page-aligned range of a mapping (MADV_POPULATE_READ/WRITE, Linux 5.14); where the
    kernel has no such advice the range is faulted in by its first touch instead."""
    if nbytes:
        try:
            mem.madvise(_POPULATE_WRITE if writable else _POPULATE_READ, offset, nbytes)
        except (OSError, ValueError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def reap(root: str | None = None) -> list[str]:
    """Remove the blob directories of stores that died without cleaning up (SIGKILL, OOM killer): this
    user's `tenplex-PORT-PID` directories whose PID no longer runs. Returns the directories removed."""
    root = root or shm_root()
    gone = []
    try:
        names = os.listdir(root)
    except OSError:
        return gone
    for name in names:
        m = _ARENA.fullmatch(name)
        path = os.path.join(root, name)
        if m is None or int(m.group(2)) == os.getpid():
            continue
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
            continue
        if not _alive(int(m.group(2))):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    if gone:
        log.info("removed the shared memory of %d dead stores: %s", len(gone), ", ".join(gone))
    return gone
