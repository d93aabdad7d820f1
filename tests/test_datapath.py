"""The store's data path: its private huge-page tmpfs, the memory reserved at start, the cleanup of both."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from tenplex.ptc import Box
from tenplex.store import MemoryLimitError, start_store
from tenplex.store.arena import Arena
from tenplex.store.tmpfs import HUGE_PAGE, host_path, open_memory

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def _can_mount() -> bool:
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not _can_mount(), reason="mounting a tmpfs needs root (CAP_SYS_ADMIN)")


def _host_mounts() -> str:
    with open("/proc/self/mounts") as f:
        return f.read()


@needs_root
def test_huge_page_store_keeps_its_mount_private_and_leaves_nothing_when_killed():
    sp = start_store(memory_limit="256MiB", extra=["--reserve", "32MiB"])
    try:
        c = sp.client()
        assert c.health()["huge_pages"] is True
        assert c.is_local  # the client found the blob directory through /proc/PID/root by itself
        a = np.arange(3 * MiB, dtype=np.float32).reshape(3, -1)
        c.write_blob("j", 1, "w", a)
        c.commit("j", 1, None)
        out = np.empty_like(a)
        c.read_box("j", 1, "w", Box.full(a.shape), out)
        assert np.array_equal(out, a)
        mountpoint = host_path(sp.shm_dir)
        assert mountpoint != sp.shm_dir and os.path.isdir(mountpoint)
        assert os.listdir(mountpoint) == []  # from outside the daemon's namespace: an empty directory
        assert sorted(os.listdir(sp.shm_dir)) == ["control.sock", "reserve"]  # the blob is in the reserve
        assert mountpoint not in _host_mounts()
    finally:
        sp.kill()
        sp.stop()
    assert not os.path.exists(mountpoint)  # the kernel took the mount with the namespace; stop() the dir
    assert mountpoint not in _host_mounts()


@needs_root
def test_a_clean_stop_removes_the_mountpoint():
    sp = start_store(memory_limit="64MiB")
    mountpoint = host_path(sp.shm_dir)
    assert os.path.isdir(mountpoint)
    assert sp.stop() == 0
    assert not os.path.exists(mountpoint)


def test_huge_pages_off_is_a_plain_directory():
    sp = start_store(memory_limit="64MiB", extra=["--huge-pages", "off"])
    try:
        c = sp.client()
        assert c.health()["huge_pages"] is False
        assert host_path(sp.shm_dir) == sp.shm_dir
        c.write_blob("j", 1, "w", np.ones(10, np.float32))
        assert sorted(os.listdir(sp.shm_dir)) == ["control.sock", "p00000001"]  # a small blob: a pack range
    finally:
        assert sp.stop() == 0
    assert not os.path.exists(sp.shm_dir)


def test_a_reserve_above_the_memory_limit_is_refused_at_start():
    cmd = [sys.executable, "-m", "tenplex.store", "--port", "0", "--memory-limit", "64MiB"]
    cmd += ["--reserve", "65MiB"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "tenplex store: error: --reserve (65MiB) exceeds --memory-limit (64MiB)"


def test_new_blobs_take_their_pages_from_the_reserve_and_the_limit_counts_it(tmp_path):
    arena = Arena("t", str(tmp_path), reserve=8 * MiB)
    try:
        assert arena.reserve.left == 8 * MiB == os.path.getsize(arena.reserve.path)
        a = arena.create(3 * MiB)  # a range of the reserve: no file of its own
        assert (a.path, a.offset, a.span, len(a.mem)) == (arena.reserve.path, 0, 8 * MiB, 3 * MiB)
        b = arena.create(5 * MiB)
        assert (b.path, b.offset, arena.reserve.left) == (arena.reserve.path, 3 * MiB, 0)
        c = arena.create(HUGE_PAGE)  # the reserve is all taken: a file of its own
        assert c.path != arena.reserve.path and (c.offset, c.span) == (0, HUGE_PAGE)
        arena.recycle(a, 3 * MiB)
        arena.recycle(c, HUGE_PAGE)
        assert (arena.pooled, arena.reserve.left) == (HUGE_PAGE, 3 * MiB)
        assert arena.create(MiB).offset == 0  # any size fits a free range
        arena.recycle(b, 5 * MiB)  # merged with the free range after the 1 MiB blob: 7 MiB in one range
        assert arena.create(7 * MiB).offset == MiB
        arena.trim(0)  # the pool and free ranges give their pages back to the kernel
        assert (arena.pooled, arena.reserve.left) == (0, 0)
        assert os.path.getsize(arena.reserve.path) == 8 * MiB  # holes: the offsets stay out of use
    finally:
        arena.close()
    assert not os.path.exists(arena.dir)


def test_the_reserve_goes_before_pooled_files_when_room_is_needed(tmp_path):
    arena = Arena("t", str(tmp_path), reserve=4 * MiB)
    try:
        whole = arena.create(4 * MiB)
        f = arena.create(HUGE_PAGE)
        arena.recycle(f, HUGE_PAGE)
        r = arena.create(HUGE_PAGE)
        assert r.path == f.path  # the reserve was full: the pooled file of that size
        arena.recycle(r, HUGE_PAGE)
        arena.recycle(whole, 4 * MiB)
        arena.trim(HUGE_PAGE)  # a pooled file of a known size is worth more than a free range
        assert (arena.pooled, arena.reserve.left) == (HUGE_PAGE, 0)
    finally:
        arena.close()


def _huge_kib(mem: mmap.mmap) -> int:
    """KiB of `mem` that the kernel maps with whole huge pages (its entry in /proc/self/smaps)."""
    start = f"{np.frombuffer(mem, np.uint8).ctypes.data:x}-"
    with open("/proc/self/smaps") as f:
        entry = f.read().split("\n" + start, 1)[1]
    return int(entry.split("ShmemPmdMapped:", 1)[1].split()[0])


@needs_root
def test_a_large_blobs_file_is_whole_huge_pages_and_a_small_ones_is_not(tmp_path):
    """tmpfs backs the part of a file short of a whole huge page with fresh 4 KiB pages, the slow part of a
    first save: a large blob's file is rounded up to huge pages, where that wastes at most an eighth. A
    small blob is a range of a pack, on 4 KiB pages (a huge page per bias vector would break the limit)."""
    arena = Arena("t", str(tmp_path), "on", 64 * MiB)
    try:
        small = arena.create(100)
        assert small.path in arena.packs and arena.footprint(100) == 4096
        small.mem[:] = b"x" * 100  # type: ignore[index]
        assert _huge_kib(arena.packs[small.path].mem) == 0
        arena.recycle(small, 100)
        made = []
        for nbytes, size in ((12_266_000, 6 * HUGE_PAGE), (3 * MiB, 3 * MiB)):
            place = arena.create(nbytes)
            path, mem = place.path, place.mem
            assert (arena.footprint(nbytes), os.path.getsize(path), len(mem)) == (size, size, nbytes)
            fd = os.open(path, os.O_RDONLY)
            whole = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
            os.close(fd)
            assert _huge_kib(whole) == size // HUGE_PAGE * HUGE_PAGE // 1024
            whole.close()
            made.append((place, nbytes))
        for place, nbytes in made:
            arena.recycle(place, nbytes)
        assert arena.pooled == 6 * HUGE_PAGE + 3 * MiB + 4096
    finally:
        arena.close()


@needs_root
def test_a_full_file_system_fails_a_pack_range_cleanly_and_free_ranges_give_way(tmp_path):
    """A pack range is backed when handed out: on a full file system that is a MemoryLimitError, never a
    SIGBUS later; a freed range is reused at once, and free ranges give their pages back to a blob that
    needs a file of its own."""
    arena = Arena("t", str(tmp_path), "on", 2 * MiB)
    try:
        small = [arena.create(100) for _ in range(2 * MiB // 4096)]  # the whole file system, 4 KiB each
        with pytest.raises(MemoryLimitError, match="no room for 100 bytes"):
            arena.create(100)
        arena.recycle(small.pop(), 100)
        assert arena.create(100).offset == 2 * MiB - 4096  # the freed range, its page still there
        for place in small[: MiB // 4096]:
            arena.recycle(place, 100)
        assert arena.pooled == MiB
        big = arena.create(MiB)  # a file of its own: the free ranges' pages go to it
        assert big.path not in arena.packs and arena.pooled == 0
        big.mem[:] = b"x" * MiB  # type: ignore[index]
    finally:
        arena.close()


@needs_root
def test_the_limit_counts_a_rounded_blob_whole_and_readers_see_only_its_bytes():
    sp = start_store(memory_limit="64MiB", extra=["--huge-pages", "on"])
    try:
        c = sp.client()
        a = np.arange(12_266_000, dtype=np.uint8)
        c.write_blob("j", 1, "w", a)
        c.commit("j", 1, None)
        assert c.stats()["memory_used"] == 6 * HUGE_PAGE
        for reader in (c, sp.client(local=False)):
            out = np.empty_like(a)
            reader.read_box("j", 1, "w", Box.full(a.shape), out)
            assert np.array_equal(out, a)
        c.delete_job("j")
        assert c.stats()["memory_used"] == 0
    finally:
        assert sp.stop() == 0


def test_reserved_used_and_pooled_memory_stay_within_the_limit():
    sp = start_store(memory_limit="16MiB", extra=["--reserve", "16MiB", "--huge-pages", "off"])
    try:
        c = sp.client()
        assert c.stats()["memory_reserved"] == 16 * MiB
        blob = np.zeros(4 * MiB // 4, np.float32)
        for step in (1, 2):
            for i in range(4):
                c.write_blob("j", step, f"b{i}", blob)
                s = c.stats()
                assert s["memory_used"] + s["memory_pooled"] + s["memory_reserved"] <= 16 * MiB
            with pytest.raises(MemoryLimitError):  # the reserve never takes the store past its limit
                c.write_blob("j", step, "more", blob)
            c.delete_version("j", step)  # its ranges go back to the reserve for the next step
            assert c.stats()["memory_reserved"] == 16 * MiB
    finally:
        assert sp.stop() == 0


def test_an_arena_off_the_main_thread_falls_back_with_a_notice(tmp_path):
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(open_memory(str(tmp_path), "m", 8 * MiB, "auto")))
    t.start()
    t.join()
    mem = got[0]
    assert not mem.huge and mem.dir == str(tmp_path / "m") and "main thread" in mem.notice
    mem.close()
    assert not os.path.exists(mem.dir)
    with pytest.raises(ValueError, match="auto, on or off"):
        open_memory(str(tmp_path), "n", 8 * MiB, "yes")


# ---------------------------------------------------------------------- host staging of snapshots


def test_staging_copies_cpu_state_once_into_buffers_reused_by_the_next_snapshot():
    import torch

    from tenplex.transformer.staging import StagingPool, stage

    pool = StagingPool()
    w, b = torch.arange(12.0).reshape(3, 4), torch.ones(5, dtype=torch.bfloat16)
    snap = stage({"w": w, "b": b}, copy_cpu=True, pool=pool)
    w.add_(100)  # the next step changes the state: the snapshot keeps the values it was taken with
    assert np.array_equal(snap.array("w"), np.arange(12.0, dtype=np.float32).reshape(3, 4))
    assert snap.array("b").dtype == np.uint16  # bfloat16 bytes travel as uint16
    first = {k: t.data_ptr() for k, t in snap.buffers.items()}
    snap.release()
    again = stage({"w": w, "b": b}, copy_cpu=True, pool=pool)
    assert pool.allocated == 2 and {k: t.data_ptr() for k, t in again.buffers.items()} == first
    assert np.array_equal(again.array("w"), w.numpy())
    again.release()
    other = stage({"w": torch.zeros(6, 4)}, copy_cpu=True, pool=pool)  # another layout: new buffers
    other.release()
    assert pool.allocated == 3 and pool.nbytes() == 6 * 4 * 4  # the old layout's buffers are freed
    view = stage({"w": w}, copy_cpu=False, pool=pool)  # a synchronous save reads a CPU tensor in place
    assert view.buffers == {} and np.shares_memory(view.array("w"), w.numpy())


def test_an_async_save_holds_the_state_of_its_step_while_training_changes_it():
    import torch

    import tenplex

    with start_store(memory_limit="256MiB") as s:
        w = torch.randn(256, 1024)
        before = w.clone()
        handle = tenplex.save({"w": w, "step": 1}, job="async", step=1, store=s.url, async_save=True)
        w.mul_(-1)  # what the optimizer does right after the snapshot call returns
        handle.wait()
        assert "stage" in handle.phases and "copy" in handle.phases
        target = {"w": torch.zeros(256, 1024), "step": 0}
        tenplex.load(target, job="async", store=s.url)
        assert torch.equal(target["w"], before) and target["step"] == 1


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device (CI and this machine have none)"
)
def test_cuda_state_is_staged_through_reused_pinned_buffers_before_the_next_kernels_change_it():
    import torch

    from tenplex.transformer.staging import StagingPool, stage

    pool = StagingPool()
    ts = {f"t{i}": torch.randn(1024, 1024, device="cuda") for i in range(8)}
    want = {k: t.cpu().numpy() for k, t in ts.items()}
    snap = stage(ts, copy_cpu=False, pool=pool)
    for t in ts.values():  # queued on the training stream right away: must run after the copies
        t.mul_(0)
    assert all(b.is_pinned() for b in snap.buffers.values())
    for k in ts:
        assert np.array_equal(snap.array(k), want[k])
    ptrs = sorted(b.data_ptr() for b in snap.buffers.values())
    snap.release()
    again = stage(ts, copy_cpu=False, pool=pool)
    assert pool.allocated == 8 and sorted(b.data_ptr() for b in again.buffers.values()) == ptrs
    assert all(np.array_equal(again.array(k), np.zeros((1024, 1024), np.float32)) for k in ts)
    again.release()


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs a CUDA device (CI and this machine have none)"
)
def test_gpu_state_round_trips_through_the_store_bit_for_bit_onto_either_device():
    import torch

    import tenplex

    with start_store(memory_limit="512MiB") as s:
        gpu = {"w": torch.randn(513, 1000, device="cuda"), "b": torch.randn(77, device="cuda").bfloat16(),
               "odd": torch.randn(64, 96, device="cuda").t(), "step": 3}  # fmt: skip
        want = {k: v.clone() for k, v in gpu.items() if k != "step"}
        handle = tenplex.save(gpu, job="gpu", step=1, store=s.url, async_save=True)
        for k in want:  # the next step's kernels, queued before the copies are done
            gpu[k].mul_(-1)
        handle.wait()
        cpu = {k: v.cpu() for k, v in want.items()} | {"step": 7}
        tenplex.save(cpu, job="cpu", step=1, store=s.url)
        for job, device, expect in (("gpu", "cuda", want), ("gpu", "cpu", cpu), ("cpu", "cuda", want)):
            target = {k: torch.zeros_like(v, device=device) for k, v in want.items()} | {"step": 0}
            tenplex.load(target, job=job, store=s.url)
            assert all(target[k].device.type == device for k in want), job
            assert all(torch.equal(target[k].cpu(), expect[k].cpu()) for k in want), (job, device)
            assert target["step"] == (3 if job == "gpu" else 7)


def test_many_blobs_are_written_with_one_allocate_and_one_seal_request_all_or_none():
    from tenplex.store import BadRequestError, NotFoundError

    with start_store(memory_limit="8MiB") as sp:
        c = sp.client()
        items = [(f"t{i}", np.full((i, 3), i, np.float32), None) for i in range(40)]
        items.append(("bf", np.arange(6, dtype=np.uint16), "bfloat16"))
        assert c.is_local  # asked once (a health request), before counting
        before = c.stats()["requests"]
        c.write_blobs("j", 1, items)
        assert c.stats()["requests"] - before == 3  # allocate, seal, and this stats call
        c.commit("j", 1, None)
        assert {b["name"]: b["dtype"] for b in c.blobs("j", 1)}["bf"] == "bfloat16"
        for name, a, _ in items:
            out = np.empty_like(a)
            c.read_box("j", 1, name, Box.full(a.shape), out)
            assert np.array_equal(out, a)
        used = c.stats()["memory_used"]
        too_big = [("a", np.zeros(MiB, np.float32), None), ("b", np.zeros(2 * MiB, np.float32), None)]
        with pytest.raises(MemoryLimitError):  # the second does not fit: the first is not kept either
            c.write_blobs("j", 2, too_big)
        assert c.stats()["memory_used"] == used
        with pytest.raises(BadRequestError, match="named twice"):
            c.write_blobs("j", 2, [("x", np.zeros(1), None), ("x", np.zeros(1), None)])
        c.request("POST", "/v1/jobs/j/versions/3/allocate", {"blobs": [{"name": "s", "dtype": "float32",
                                                                         "shape": [4]}]})  # fmt: skip
        with pytest.raises(BadRequestError, match="digests of 's'"):  # checked before any blob is sealed
            c.request("POST", "/v1/jobs/j/versions/3/seal", {"blobs": [{"name": "s", "digests": [1, 2]}]})
        with pytest.raises(NotFoundError):
            c.request("POST", "/v1/jobs/j/versions/3/seal", {"blobs": [{"name": "nope", "digests": [0]}]})
