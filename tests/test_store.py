"""Tensor store: real daemons on free ports, real sockets, both client paths (shared memory and network)."""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex.cli.main import main as cli_main
from tenplex.ptc import ITEM_SIZE, Box
from tenplex.store import (
    AuthError,
    BadRequestError,
    ChecksumError,
    ConflictError,
    MemoryLimitError,
    NotFoundError,
    StoreClient,
    hold_relayed_many,
    read_many,
    start_store,
)
from tenplex.store.keys import NUMPY_DTYPE
from tenplex.store.protocol import Conn

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300_000), max_size=40) | st.lists(st.integers(0, 64), max_size=1200),
    early=st.integers(0, 5000),
)
def test_gather_writes_and_scatter_reads_carry_any_views_however_the_kernel_cuts_them(sizes, early):
    """A read's many boxes go out in a few `sendmsg` calls and land by `recvmsg_into`: each call may move
    any number of bytes, stopping mid-view, and the first bytes may have come with the answer's head."""
    body = np.random.default_rng(len(sizes)).integers(0, 256, size=sum(sizes), dtype=np.uint8)
    a, b = socket.socketpair()
    for sock, opt in ((a, socket.SO_SNDBUF), (b, socket.SO_RCVBUF)):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4096)  # small buffers: partial calls all the time
        sock.settimeout(10)  # a lost or extra byte fails the test instead of hanging it
    send, recv = Conn(a), Conn(b)
    cuts = list(itertools.pairwise(np.cumsum([0, *sizes])))
    out = np.zeros_like(body)
    views = [memoryview(body)[i:j] for i, j in cuts]
    writer = threading.Thread(target=send.send_many, args=(views,), daemon=True)
    writer.start()
    early = min(early, len(body))
    while len(recv._buf) < early:  # what a head's read took of the body
        recv._buf += recv.sock.recv(early - len(recv._buf))
    recv.read_many_into([memoryview(out)[i:j] for i, j in cuts])
    writer.join(2)
    done = not writer.is_alive()
    exact = done and recv.open()  # nothing more was sent than was read
    a.close(), b.close()
    assert done and exact and np.array_equal(out, body)


@pytest.fixture(params=[True, False], ids=["shm", "net"])
def client(request, store) -> StoreClient:
    c = store.client(local=request.param)
    assert c.is_local is request.param
    return c


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.integers(0, 120, size=shape).astype(NUMPY_DTYPE[dtype])


def blob_path(c: StoreClient, job: str, step: int, name: str) -> str:
    """The shared-memory file of a blob, asked the way a reader asks (and its lease ended)."""
    leased = c.transport.lease("POST", f"/v1/jobs/{job}/versions/{step}/locate", {"names": [name]})
    c.transport.end_lease(leased)
    return leased.answer["blobs"][0]["path"]


def job_name(request) -> str:
    return "j-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:100]


@pytest.mark.parametrize("dtype", sorted(ITEM_SIZE))
def test_every_dtype_roundtrip(client, dtype, request):
    job = job_name(request)
    shapes = {"m": (7, 5), "s": (), "e": (0, 3), "v": (1000,)}
    arrays = {k: sample(dtype, s, i) for i, (k, s) in enumerate(shapes.items())}
    client.create_version(job, 1)
    for name, a in arrays.items():
        client.write_blob(job, 1, f"r0/{name}", a, dtype=dtype)
    client.commit(job, 1, {"dtype": dtype})
    for b in client.blobs(job, 1):
        assert b["dtype"] == dtype and tuple(b["shape"]) == shapes[b["name"][3:]]
    for name, a in arrays.items():
        out = np.empty(a.shape, dtype=NUMPY_DTYPE[dtype])
        client.read_box(job, 1, f"r0/{name}", Box.full(a.shape), out)
        np.testing.assert_array_equal(out, a)
    client.delete_job(job)


def test_bfloat16_accepts_two_byte_buffers_but_not_others(client, request):
    job = job_name(request)
    a = np.arange(12, dtype=np.uint16).reshape(3, 4)
    client.write_blob(job, 0, "w", a, dtype="bfloat16")
    client.commit(job, 0, None)
    out = np.empty((3, 2), dtype=np.int16)
    client.read_box(job, 0, "w", Box((0, 2), (3, 4)), out)
    np.testing.assert_array_equal(out, a[:, 2:].astype(np.int16))
    with pytest.raises(BadRequestError):
        client.read_box(job, 0, "w", Box((0, 0), (3, 2)), np.empty((3, 2), np.float32))
    with pytest.raises(BadRequestError):
        client.write_blob(job, 1, "w", a, dtype="float32")
    client.delete_job(job)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_box_reads_match_numpy_slicing(store, data):
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=4)))
    box = Box.from_slices(
        [data.draw(st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted)) for n in shape]
    )
    local = data.draw(st.booleans())
    c = store.client(local=local)
    a = sample("int32", shape, 1)
    c.write_blob("hyp", 0, "a", a)
    c.commit("hyp", 0, None)
    out = np.full(box.shape, -1, dtype=np.int32)
    c.read_box("hyp", 0, "a", box, out)
    np.testing.assert_array_equal(out, a[box.slices()])
    c.delete_version("hyp", 0)


def test_edges_empty_boxes_and_out_of_range(client, request):
    job = job_name(request)
    a = sample("float32", (16, 8), 2)
    client.write_blob(job, 3, "w", a)
    client.commit(job, 3, None)
    for box in [Box((15, 7), (16, 8)), Box((0, 0), (16, 1)), Box((16, 8), (16, 8)), Box((4, 2), (4, 6))]:
        out = np.empty(box.shape, np.float32)
        client.read_box(job, 3, "w", box, out)
        np.testing.assert_array_equal(out, a[box.slices()])
    for box in [Box((0, 0), (17, 8)), Box((0,), (4,)), Box((0, 0, 0), (1, 1, 1))]:
        with pytest.raises(BadRequestError):
            client.read_box(job, 3, "w", box, np.empty(box.shape, np.float32))
    with pytest.raises(BadRequestError):  # out does not match the box
        client.read_box(job, 3, "w", Box((0, 0), (2, 2)), np.empty((2, 3), np.float32))
    with pytest.raises(NotFoundError):
        client.read_box(job, 3, "nope", Box((0,), (1,)), np.empty(1, np.float32))
    client.delete_job(job)


def test_large_strided_boxes_use_slabs(client, request, monkeypatch):
    """Boxes larger than the daemon's reusable buffer, with rows larger than it, come out right, and go in
    slabs: the network path as pieces of the blob or of the one reused buffer (never a new allocation),
    the shared-memory path verified and copied a few leading rows at a time."""
    from tenplex.store import boxio

    job = job_name(request)
    a = sample("uint8", (2, 9 << 20), 3)  # a row is larger than the buffer
    b = sample("float32", (2048, 1536), 4)
    cases = [("a", a, Box((0, 1), (2, 9 << 20))), ("b", b, Box((3, 100), (2045, 1500)))]
    assert cases[1][2].volume * 4 > boxio.SCRATCH  # larger than the buffer: more than one slab
    client.write_blob(job, 0, "a", a)
    client.write_blob(job, 0, "b", b)
    client.commit(job, 0, None)
    spans: list[tuple[int, int]] = []
    verify = boxio.verify_span
    monkeypatch.setattr(
        boxio, "verify_span", lambda d, g, lo, hi, w: (spans.append((lo, hi)), verify(d, g, lo, hi, w))
    )
    for name, arr, box in cases:
        out = np.empty(box.shape, arr.dtype)
        spans.clear()
        client.read_box(job, 0, name, box, out)
        np.testing.assert_array_equal(out, arr[box.slices()])
        if client.is_local:  # copied here: one verified span per slab of SLAB bytes of leading rows
            rows = max(1, boxio.SLAB // arr.strides[0])
            assert len(spans) == -(-box.shape[0] // rows) > 1
        else:  # sent by the daemon through boxio.pieces: the same pieces, observed in this process
            scratch = np.empty(boxio.SCRATCH, np.uint8)
            view, got, buffered = arr[box.slices()], bytearray(), 0
            for piece in boxio.pieces(view, scratch):
                inner = np.frombuffer(piece, np.uint8)
                in_scratch = np.shares_memory(inner, scratch)
                assert in_scratch != np.shares_memory(inner, arr)  # the buffer or the blob, nothing else
                assert piece.nbytes <= boxio.SCRATCH or not in_scratch
                buffered += in_scratch
                got += piece
            assert bytes(got) == view.tobytes()
            row = view[0].nbytes
            expected = view.shape[0] if row > boxio.SCRATCH else -(-view.shape[0] // (boxio.SCRATCH // row))
            assert buffered == (0 if name == "a" else expected) and expected > 1
    client.delete_job(job)


def test_multi_box_reads_and_read_many(store, request):
    job = job_name(request)
    other = start_store(memory_limit="64MiB")
    try:
        clients = [store.client(local=False), other.client(local=False), store.client(local=True)]
        arrays = {f"r{i}/t": sample("float64", (20, 30), i) for i in range(4)}
        for c in clients[:2]:
            for name, a in arrays.items():
                c.write_blob(job, 5, name, a)
            c.commit(job, 5, {})
        boxes = [
            (name, Box((i, j), (i + 3, j + 7))) for name in arrays for i in range(0, 17, 4) for j in (0, 23)
        ]
        for c in clients:
            outs = [np.empty(b.shape) for _, b in boxes]
            c.read_boxes(job, 5, [(n, b, o) for (n, b), o in zip(boxes, outs)])
            for (n, b), o in zip(boxes, outs):
                np.testing.assert_array_equal(o, arrays[n][b.slices()])
        reqs, expect = [], []
        for k in range(300):
            c = clients[k % 3]
            n, b = boxes[k % len(boxes)]
            reqs.append((c, job, 5, n, b, np.empty(b.shape)))
            expect.append(arrays[n][b.slices()])
        read_many(reqs, concurrency=4)
        for r, e in zip(reqs, expect):
            np.testing.assert_array_equal(r[5], e)
        with pytest.raises(NotFoundError):
            read_many([(clients[0], job, 6, "r0/t", Box((0, 0), (1, 1)), np.empty((1, 1)))])
    finally:
        other.stop()
        store.client().delete_job(job)


def test_versions_commit_retain_delete(client, request):
    job = job_name(request)
    assert client.versions(job) == [] and client.latest(job) is None
    client.create_version(job, 5)  # an old pending version (a crashed save, opened before those kept)
    for step in (10, 20, 30, 40):
        client.create_version(job, step)
        client.create_version(job, step)  # idempotent
        client.write_blob(job, step, "x", np.full(4, step, np.int64))
        assert step not in client.versions(job)  # invisible until committed
        with pytest.raises(NotFoundError):
            client.manifest(job, step)
        client.commit(job, step, {"step": step})
        client.commit(job, step, {"step": step})  # idempotent
    with pytest.raises(ConflictError):
        client.write_blob(job, 20, "y", np.zeros(2))
    assert client.versions(job) == [10, 20, 30, 40] and client.latest(job) == 40
    assert client.manifest(job, 30) == {"step": 30}
    assert job in client.jobs()
    assert client.retain(job, keep=2) == []  # no save known complete: a commit may be a torn save's
    assert client.retain(job, keep=2, protect=(40, None)) == [5, 10, 20]  # 40 is complete: the anchor
    assert client.versions(job) == [30, 40]
    client.delete_version(job, 40)
    assert client.latest(job) == 30
    with pytest.raises(NotFoundError):
        client.delete_version(job, 40)
    client.delete_job(job)
    assert job not in client.jobs()
    with pytest.raises(NotFoundError):
        client.delete_job(job)


def test_atomic_commit_under_concurrent_readers(store, request):
    """Readers polling `latest` always find a complete version: all blobs there, all bytes of that step."""
    job = job_name(request)
    writer = store.client(local=True)
    failures: list[str] = []
    seen: set[int] = set()
    done = threading.Event()

    def reader(local: bool) -> None:
        try:
            c = store.client(local=local)
            while not done.is_set():
                step = c.latest(job)
                if step is None:
                    continue
                outs = [np.empty((64, 64), np.int32) for _ in range(3)]
                try:
                    c.read_boxes(job, step, [(f"b{i}", Box.full((64, 64)), o) for i, o in enumerate(outs)])
                except NotFoundError:  # retained away meanwhile
                    continue
                if any((o != step).any() for o in outs):
                    failures.append(f"torn read of step {step}")
                seen.add(step)
        except BaseException as e:  # any other error fails the test instead of ending the thread quietly
            failures.append(f"reader (local={local}) died: {e!r}")

    threads = [threading.Thread(target=reader, args=(loc,)) for loc in (True, False, True)]
    for t in threads:
        t.start()
    for step in range(1, 40):
        for i in range(3):
            writer.write_blob(job, step, f"b{i}", np.full((64, 64), step, np.int32))
            time.sleep(0.001)
        writer.commit(job, step, None)
        writer.retain(job, keep=3)
    done.set()
    for t in threads:
        t.join()
    assert not failures
    assert len(seen) > 3
    writer.delete_job(job)


WRITER = """
import os, sys, numpy as np
from tenplex.store import StoreClient
c = StoreClient(sys.argv[1], local=sys.argv[2] == "1")
c.write_blob("crash", 7, "r0/done", np.ones(1000, np.float32))
if sys.argv[2] == "1":
    a = c.allocate_blob("crash", 7, "r0/half", "float32", (1000,))
    a[:500] = 1
else:  # a PUT whose body stops halfway
    from tenplex.store.auth import handshake
    from tenplex.store.protocol import connect
    conn = connect(c.host, c.port, 10)
    handshake(conn, c.url, c.token)
    conn.sock.sendall(b"PUT /v1/jobs/crash/versions/7/blobs/r0%2Fhalf?dtype=float32&shape=1000 HTTP/1.1\\r\\n"
                      b"Content-Length: 4000\\r\\n\\r\\n" + b"\\0" * 2000)
os._exit(9)
"""


@pytest.mark.parametrize("local", [True, False], ids=["shm", "net"])
def test_writer_crash_mid_blob_leaves_version_invisible(store, local):
    c = store.client(local=local)
    used = c.stats()["memory_used"]
    proc = subprocess.run([sys.executable, "-c", WRITER, store.url, "1" if local else "0"], timeout=60)
    assert proc.returncode == 9
    assert 7 not in c.versions("crash")
    with pytest.raises(NotFoundError):
        c.read_box("crash", 7, "r0/done", Box((0,), (1,)), np.empty(1, np.float32))
    if local:
        with pytest.raises(ConflictError, match="not sealed"):
            c.commit("crash", 7, None)
    else:
        deadline = time.time() + 10  # the daemon notices the truncated body and frees its memory
        while c.stats()["memory_used"] != used + mmap.PAGESIZE and time.time() < deadline:
            time.sleep(0.05)
        assert c.stats()["memory_used"] == used + mmap.PAGESIZE
    # a restarted writer redoes the version and commits it
    c.write_blob("crash", 7, "r0/half", np.full(1000, 2, np.float32))
    c.commit("crash", 7, None)
    out = np.empty(1000, np.float32)
    c.read_box("crash", 7, "r0/half", Box((0,), (1000,)), out)
    assert (out == 2).all()
    c.delete_job("crash")
    assert c.stats()["memory_used"] == used


def test_checksum_mismatch_is_detected_not_loaded(store, request):
    job = job_name(request)
    c = store.client(local=True)
    a = sample("uint8", (3 << 20,), 5)
    c.write_blob(job, 1, "w", a)
    c.commit(job, 1, None)
    path = blob_path(c, job, 1, "w")
    assert os.path.basename(path).startswith("b")  # generated file name, never the blob name
    with open(path, "r+b") as f:  # flip one byte in the second 1 MiB chunk
        f.seek((1 << 20) + 12345)
        byte = f.read(1)
        f.seek((1 << 20) + 12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    for local in (True, False):
        cl = store.client(local=local)
        out = np.zeros(3 << 20, np.uint8)
        with pytest.raises(ChecksumError, match="corrupted"):
            cl.read_box(job, 1, "w", Box((0,), (3 << 20,)), out)
        with pytest.raises(ChecksumError):
            cl.read_box(
                job, 1, "w", Box(((1 << 20) + 12000,), ((1 << 20) + 13000,)), np.empty(1000, np.uint8)
            )
        part = np.empty(1000, np.uint8)  # a box in an intact chunk still reads
        cl.read_box(job, 1, "w", Box((10,), (1010,)), part)
        np.testing.assert_array_equal(part, a[10:1010])
        assert cl.health()["ok"]
    c.delete_job(job)


def test_held_boxes_are_verified_and_stay_the_verified_bytes_until_released(store, request):
    """`hold_boxes` verifies a box where it lies and keeps its blob held: a delete and a new save of the
    same size meanwhile cannot recycle the file under the holder; a corrupted chunk or another dtype
    raises before anything is handed out; a store on another host is refused."""
    job = job_name(request)
    c = store.client(local=True)
    a = sample("float32", (1 << 18, 2), 7)  # 2 MiB: two checksum chunks
    c.write_blob(job, 1, "w", a)
    c.commit(job, 1, None)
    held = c.hold_boxes(
        job, 1, [("w", Box((10, 0), (20, 2)), "float32"), ("w", Box((0, 1), (5, 2)), "float32")]
    )
    c.delete_version(job, 1)  # deleted while held: its file goes to the pool only at the release
    c.write_blob(job, 2, "w", np.zeros_like(a))
    c.commit(job, 2, None)
    np.testing.assert_array_equal(held.arrays[0], a[10:20])  # not the new save's zeros
    np.testing.assert_array_equal(held.arrays[1], a[0:5, 1:2])
    assert not held.arrays[0].flags.writeable
    used = c.stats()["memory_used"]
    held.close()
    held.close()  # once
    deadline = time.monotonic() + 5  # the release is sent without waiting for its answer
    while c.stats()["memory_used"] == used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.stats()["memory_used"] == used - a.nbytes
    path = blob_path(c, job, 2, "w")
    with open(path, "r+b") as f:  # flip a byte in the second chunk
        f.seek((1 << 20) + 8)
        byte = f.read(1)
        f.seek((1 << 20) + 8)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match="corrupted"):
        c.hold_boxes(job, 2, [("w", Box((0, 0), (1 << 18, 2)), "float32")])
    c.hold_boxes(job, 2, [("w", Box((0, 0), (4, 2)), "float32")]).close()  # an intact chunk still holds
    with pytest.raises(BadRequestError, match="holds float32, int32 expected"):  # never reinterpreted
        c.hold_boxes(job, 2, [("w", Box((0, 0), (4, 2)), "int32")])
    with pytest.raises(BadRequestError, match="not on this host"):
        store.client(local=False).hold_boxes(job, 2, [("w", Box((0, 0), (4, 2)), "float32")])
    c.delete_job(job)


def test_allocate_and_seal(store, request):
    job = job_name(request)
    c = store.client(local=True)
    a = c.allocate_blob(job, 2, "r1/w", "float32", (128, 64))
    a[:] = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)
    with pytest.raises(ConflictError):
        c.commit(job, 2, None)
    c.seal_blob(job, 2, "r1/w")
    c.commit(job, 2, None)
    out = np.empty((2, 64), np.float32)
    store.client(local=False).read_box(job, 2, "r1/w", Box((5, 0), (7, 64)), out)
    np.testing.assert_array_equal(out, a[5:7])
    with pytest.raises(ConflictError):
        store.client(local=False).allocate_blob(job, 3, "x", "float32", (1,))
    c.delete_job(job)


def test_memory_limit_refuses_writes_and_keeps_committed_data():
    with start_store(memory_limit="1MiB") as sp:
        for local in (True, False):
            c = sp.client(local=local)
            a = np.ones(600 << 10, np.uint8)
            c.write_blob("m", 1, "a", a)
            c.commit("m", 1, None)
            with pytest.raises(MemoryLimitError, match="memory limit"):
                c.write_blob("m", 2, "a", a)
            out = np.empty_like(a)
            c.read_box("m", 1, "a", Box.full(a.shape), out)
            assert (out == 1).all()
            assert c.stats()["memory_used"] == a.nbytes
            c.delete_version("m", 1)
            c.write_blob("m", 2, "a", a)  # room again
            c.delete_job("m")
            assert c.stats()["memory_used"] == 0


def test_a_relay_request_of_many_boxes_fetches_them_together(request):
    """50 blobs relayed in one request (and a box named twice): each arrives right, each is cached once, and
    the remote store answers a handful of requests, not one or more per box."""
    job = job_name(request)
    with start_store(memory_limit="64MiB") as remote, start_store(memory_limit="64MiB") as here:
        rc = remote.client(local=False)
        blobs = {f"w{i}": sample("float32", (16, 8 + i), i) for i in range(50)}
        rc.write_blobs(job, 3, [(n, a, None) for n, a in blobs.items()])
        rc.commit(job, 3, None)
        before = rc.stats()["requests"]
        box = Box((2, 1), (9, 7))
        for local in (True, False):
            items = [(n, box, np.empty(box.shape, np.float32)) for n in blobs] + [
                ("w7", None, np.empty((16, 15), np.float32))
            ]
            here.client(local=local).fetch_remote_many(remote.url, job, 3, items)
            for n, b, out in items:
                np.testing.assert_array_equal(out, blobs[n][b.slices()] if b is not None else blobs[n])
        assert here.client().stats()["relay_blobs"] == 51
        assert rc.stats()["requests"] - before <= 12  # per fetch: hello, blobs list, one batched read
        with pytest.raises(NotFoundError):
            here.client().fetch_remote_many(remote.url, job, 3, [("nope", None, np.empty(1, np.float32))])
        assert here.client().stats()["relay_blobs"] == 51  # the failed fetch left nothing behind


def test_held_relayed_boxes_are_verified_and_outlive_a_dropped_relay(request):
    """`hold_relayed_many`: boxes of two other stores are fetched once into this host's store, verified
    there and held; each hold names the requests it answers (two peers, interleaved); a dropped relay
    cache does not free what is held; a corrupted relay copy, another dtype, or a store on another host is
    refused before anything is handed out."""
    job = job_name(request)
    with (
        start_store(memory_limit="64MiB") as one,
        start_store(memory_limit="64MiB") as two,
        start_store(memory_limit="64MiB") as here,
    ):
        data = {}
        for k, peer in enumerate((one, two)):
            pc = peer.client(local=False)
            data[peer.url] = sample("float32", (1 << 18, 2), 10 + k)  # 2 MiB: two checksum chunks
            pc.write_blob(job, 1, "w", data[peer.url])
            pc.commit(job, 1, None)
        hc = here.client(local=True)
        # contiguous from a chunk boundary (its checksums verified on arrival are the relay copy's own),
        # contiguous from inside a chunk and strided (the copy's checksums computed afresh)
        boxes = [Box((0, 0), (4, 2)), Box((0, 0), ((1 << 17) + 5, 2)), Box((100, 0), (1 << 18, 2)),
                 Box((100, 1), (1 << 18, 2)), Box((7, 0), (9, 1))]  # fmt: skip
        asked = [(hc, p.url, "w", b, "float32") for b in boxes for p in (one, two)]  # peers interleaved
        made = hold_relayed_many(asked, job, 1, concurrency=2)
        assert sorted(i for _, which in made for i in which) == list(range(len(asked)))
        assert hc.drop_relay(job, 1) == len(asked)  # dropped while held: the files stay until the release
        for h, which in made:
            for arr, i in zip(h.arrays, which, strict=True):
                _, url, _, box, _ = asked[i]
                np.testing.assert_array_equal(arr, data[url][box.slices()])
                assert not arr.flags.writeable
            h.close()
        deadline = time.monotonic() + 5  # the release is sent without waiting for its answer
        while hc.stats()["memory_used"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hc.stats()["memory_used"] == 0
        whole = Box((0, 0), (1 << 18, 2))
        # where the relay keeps its copy: flip a byte of its second chunk
        payload = hc.relay.payload(one.url, job, 1, [("w", whole, None)], None)
        leased = hc.transport.lease("POST", "/v1/relay", payload)
        hc.transport.end_lease(leased)
        found = leased.answer
        at = found["blobs"][0]["offset"] + (1 << 20) + 8  # a blob's bytes start at its offset in the file
        with open(found["blobs"][0]["path"], "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(ChecksumError, match="corrupted"):
            hc.hold_relayed(one.url, job, 1, [("w", whole, "float32")])
        with pytest.raises(BadRequestError, match="holds float32, int32 expected"):  # never reinterpreted
            hc.hold_relayed(two.url, job, 1, [("w", whole, "int32")])
        with pytest.raises(BadRequestError, match="not on this host"):
            here.client(local=False).hold_relayed(two.url, job, 1, [("w", whole, "float32")])


def test_a_relay_from_a_store_whose_copy_is_corrupted_raises_and_keeps_nothing(request):
    """The sending store does not hash the whole chunks it sends (the receiver checks them against the
    saved checksums): a byte flipped in the sender's memory is still refused on arrival, the relay cache
    keeps nothing of the failed fetch, and a box of an intact chunk still relays."""
    job = job_name(request)
    with start_store(memory_limit="64MiB") as remote, start_store(memory_limit="64MiB") as here:
        rc = remote.client(local=True)
        a = sample("uint8", (3 << 20,), 8)
        rc.write_blob(job, 1, "w", a)
        rc.commit(job, 1, None)
        with open(blob_path(rc, job, 1, "w"), "r+b") as f:  # a byte in the middle chunk: a whole chunk
            f.seek((1 << 20) + 77)
            byte = f.read(1)
            f.seek((1 << 20) + 77)
            f.write(bytes([byte[0] ^ 0xFF]))
        hc = here.client(local=True)
        for box in (None, Box((5,), ((2 << 20) + 9,))):  # the whole blob; one covering the chunk
            with pytest.raises(ChecksumError, match="corrupted"):
                hc.fetch_remote(
                    remote.url, job, 1, "w", box, np.empty(box.shape if box else a.shape, np.uint8)
                )
        assert hc.stats()["relay_blobs"] == 0
        part = np.empty(1000, np.uint8)
        hc.fetch_remote(remote.url, job, 1, "w", Box((10,), (1010,)), part)
        np.testing.assert_array_equal(part, a[10:1010])
        assert hc.stats()["relay_blobs"] == 1


def test_relay_fetches_remote_bytes_once(request):
    job = job_name(request)
    with start_store(memory_limit="64MiB") as remote, start_store(memory_limit="64MiB") as here:
        rc = remote.client(local=False)
        a = sample("float32", (256, 1024), 6)
        rc.write_blob(job, 4, "w", a)
        rc.commit(job, 4, None)
        sent = rc.stats()["bytes_out"]
        box = Box((10, 0), (200, 512))
        outs: list[np.ndarray] = []

        def rank(local: bool) -> None:
            out = np.empty(box.shape, np.float32)
            here.client(local=local).fetch_remote(remote.url, job, 4, "w", box, out)
            outs.append(out)

        threads = [threading.Thread(target=rank, args=(i % 2 == 0,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outs) == 4
        for o in outs:
            np.testing.assert_array_equal(o, a[box.slices()])
        crossed = rc.stats()["bytes_out"] - sent
        assert box.volume * 4 <= crossed < box.volume * 4 + 4096  # once, not four times
        whole = np.empty(a.shape, np.float32)
        here.client().fetch_remote(remote.url, job, 4, "w", None, whole)
        np.testing.assert_array_equal(whole, a)
        hc = here.client()
        assert hc.stats()["relay_blobs"] == 2
        assert hc.drop_relay(job, 4) == 2
        assert hc.stats()["memory_used"] == 0
        with pytest.raises(NotFoundError):
            hc.fetch_remote(remote.url, job, 5, "w", None, whole)


def test_store_ls_cli(store, capsys, request):
    job = job_name(request)
    c = store.client()
    c.write_blob(job, 9, "r0/emb", np.zeros((4, 4), np.float16))
    c.commit(job, 9, None)
    assert cli_main(["store", "ls", "--store", store.url]) == 0
    assert job in capsys.readouterr().out
    assert cli_main(["store", "ls", "--store", store.url, "--blobs"]) == 0
    assert "r0/emb" in capsys.readouterr().out
    assert cli_main(["store", "ls", "--store", "http://127.0.0.1:1"]) == 2
    c.delete_job(job)


def test_freed_files_are_recycled_within_the_limit(request):
    """Periodic snapshots reuse the files of deleted versions; the pool never breaks the limit."""
    job = job_name(request)
    with start_store(memory_limit="1MiB") as sp:
        c = sp.client(local=True)
        c.write_blob(job, 1, "w", np.full(1000, 1, np.int64))
        c.commit(job, 1, None)
        first = blob_path(c, job, 1, "w")
        c.delete_version(job, 1)
        assert c.stats()["memory_pooled"] == 8192 and c.stats()["memory_used"] == 0
        c.write_blob(job, 2, "w", np.full(1000, 2, np.int64))  # no reader holds it: reused at once
        c.commit(job, 2, None)
        assert blob_path(c, job, 2, "w") == first
        out = np.empty(1000, np.int64)
        sp.client(local=False).read_box(job, 2, "w", Box((0,), (1000,)), out)
        assert (out == 2).all()
        c.delete_version(job, 2)
        c.write_blob(job, 3, "big", np.zeros(1 << 20, np.uint8))  # needs the pooled bytes back
        assert c.stats()["memory_pooled"] == 0


def test_a_blob_of_a_new_size_takes_a_larger_pooled_files_pages(request):
    """After a reconfiguration no pooled file has a new blob's size: the smallest larger one is cut to size
    (its pages are taken already, fresh ones cost a first touch), and a client that mapped the file at its
    old size reads the new blob's bytes, never the old ones."""
    job = job_name(request)
    with start_store(memory_limit="16MiB") as sp:
        c, net = sp.client(local=True), sp.client(local=False)
        c.write_blob(job, 1, "small", np.full(1 << 18, 7, np.float32))  # 1 MiB: stays pooled, too small
        c.write_blob(job, 1, "w", np.full(3 << 18, 1, np.float32))  # 3 MiB
        c.commit(job, 1, None)
        first = blob_path(c, job, 1, "w")
        out = np.empty(3 << 18, np.float32)
        c.read_box(job, 1, "w", Box((0,), out.shape), out)  # this client now maps it at 3 MiB
        c.delete_version(job, 1)
        assert c.stats()["memory_pooled"] == 4 << 20
        new = sample("float32", (1 << 19, 1), 5)  # 2 MiB: the 3 MiB file, cut, not the 1 MiB one
        c.write_blob(job, 2, "v", new)
        c.commit(job, 2, None)
        assert blob_path(c, job, 2, "v") == first
        assert c.stats()["memory_pooled"] == 1 << 20 and c.stats()["memory_used"] == new.nbytes
        for reader in (c, net):
            got = np.empty_like(new)
            reader.read_box(job, 2, "v", Box((0, 0), new.shape), got)
            np.testing.assert_array_equal(got, new)
        c.write_blob(job, 3, "w", np.full(3 << 18, 3, np.float32))  # the old size again: a file of its own
        c.commit(job, 3, None)
        c.read_box(job, 3, "w", Box((0,), out.shape), out)
        assert (out == 3).all() and blob_path(c, job, 3, "w") != first
        c.delete_job(job)


def test_pooled_files_a_client_still_maps_give_their_memory_back_when_trimmed(request):
    """A client caches the mappings of blob files it read; a mapping keeps an unlinked file's pages, so a
    store that made room by unlinking pooled files ran out of space below its limit (ENOSPC on writing
    blobs of new sizes while the old ones were still mapped: the loopback benchmark's fourth case)."""
    job = job_name(request)
    with start_store(memory_limit="16MiB") as sp:
        c = sp.client(local=True)
        if not c.health()["huge_pages"]:
            pytest.skip("the store has no private tmpfs here, so its file system has no limit to hit")
        old = np.full(3 << 18, 1, np.float32)  # 3 MiB each: four fill 12 of the 16 MiB
        for i in range(4):
            c.write_blob(job, 1, f"a{i}", old)
        c.commit(job, 1, None)
        out = np.empty_like(old)
        for i in range(4):
            c.read_box(job, 1, f"a{i}", Box((0,), old.shape), out)  # now mapped by this client
        c.delete_version(job, 1)
        assert c.stats()["memory_pooled"] == 12 << 20
        for i in range(4):  # 16 MiB of another size: every pooled file must go, mapped or not
            c.write_blob(job, 2, f"b{i}", np.full(1 << 20, 2, np.float32))
        c.commit(job, 2, None)
        big = np.empty(1 << 20, np.float32)
        c.read_box(job, 2, "b3", Box((0,), big.shape), big)
        assert (big == 2).all() and c.stats()["memory_pooled"] == 0


def test_the_memory_limit_counts_whole_pages(request):
    """A blob file takes whole pages of memory: counted in bytes, 100-byte blobs filled a store's file
    system at a quarter of its limit's worth of blob bytes and failed with ENOSPC from deep inside."""
    job = job_name(request)
    with start_store(memory_limit="2MiB") as sp:
        c = sp.client(local=True)
        fit = (2 << 20) // mmap.PAGESIZE
        with pytest.raises(MemoryLimitError, match="would exceed the memory limit"):
            for i in range(fit + 1):
                c.write_blob(job, 1, f"b{i}", np.zeros(100, np.uint8))
        assert i == fit and c.stats()["memory_used"] == fit * mmap.PAGESIZE
        c.delete_job(job)
        assert c.stats()["memory_used"] == 0


def test_a_network_read_has_released_its_blobs_when_the_reader_has_the_answer(request):
    """The daemon lets go of the blobs it serves before the answer's last bytes (the checksum trailer), so
    a delete right after a read frees their memory at once (it raced the release, which made the test
    above fail now and then)."""
    job = job_name(request)
    with start_store(memory_limit="8MiB") as sp:
        local, net = sp.client(local=True), sp.client(local=False)
        out = np.empty(1 << 18, np.float32)
        for step in range(1, 41):
            local.write_blob(job, step, "w", np.full(1 << 18, step, np.float32))
            local.commit(job, step, None)
            net.read_box(job, step, "w", Box((0,), (1 << 18,)), out)
            assert (out == step).all()
            local.delete_version(job, step)
            assert local.stats()["memory_used"] == 0, step


BIG = np.random.default_rng(3).random((2048, 1024), dtype=np.float32)  # 8 MiB: 8 checksum chunks


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_strided_box_copies_verify_in_slabs_and_still_catch_every_corrupted_chunk(data):
    from tenplex.store.boxio import copy_box
    from tenplex.store.checksum import CHUNK, byte_span, chunk_digests

    r0 = data.draw(st.integers(0, 2047))
    r1 = data.draw(st.integers(r0 + 1, 2048))
    c0 = data.draw(st.integers(0, 1022))
    c1 = data.draw(st.integers(c0 + 1, 1023))  # never all columns: a strided view
    box = Box((r0, c0), (r1, c1))
    blob = BIG.copy()
    raw = memoryview(blob.reshape(-1).view(np.uint8))
    digests = chunk_digests(raw)
    out = np.empty(box.shape, np.float32)
    copy_box(raw, digests, "float32", blob.shape, box, out, "w")
    np.testing.assert_array_equal(out, BIG[r0:r1, c0:c1])
    bad = data.draw(st.integers(0, len(raw) - 1))
    raw[bad] ^= 0xFF
    lo, hi = byte_span(box, blob.shape, 4)
    if lo // CHUNK <= bad // CHUNK <= (hi - 1) // CHUNK:  # the box touches the corrupted chunk
        with pytest.raises(ChecksumError, match="corrupted"):
            copy_box(raw, digests, "float32", blob.shape, box, out, "w")
    else:
        copy_box(raw, digests, "float32", blob.shape, box, out, "w")
        np.testing.assert_array_equal(out, BIG[r0:r1, c0:c1])


def test_a_commit_naming_its_blobs_drops_the_leftovers_of_an_abandoned_attempt(store, request):
    job = job_name(request)
    c = store.client(local=True)
    used = c.stats()["memory_used"]
    c.create_version(job, 1)
    c.allocate_blob(job, 1, "r1/dead", "float32", (1000,))  # its writer died before sealing it
    c.write_blob(job, 1, "r0/w", sample("float32", (10,)))
    with pytest.raises(ConflictError, match="blobs missing: \\['r0/x'\\]"):
        c.commit(job, 1, None, blobs=["r0/w", "r0/x"])
    with pytest.raises(BadRequestError):
        c.request("POST", f"/v1/jobs/{job}/versions/1/commit", {"manifest": None, "blobs": "r0/w"})
    c.commit(job, 1, {"save_id": "s1"}, blobs=["r0/w"])
    assert [b["name"] for b in c.blobs(job, 1)] == ["r0/w"]
    assert c.save_ids(job) == {1: "s1"}
    assert c.stats()["memory_used"] == used + mmap.PAGESIZE  # the dead writer's blob is freed
    c.delete_job(job)


# The protocol v1 operations as docs/store.md lists them: written here, not taken from the route table
# the OpenAPI document is generated from, so a route added, dropped or renamed shows up. A dataset's
# path parameter is called `job` there (the daemon checks it as a job name); docs/store.md writes {name}.
V = "/v1/jobs/{job}/versions/{step}"
PROTOCOL_V1 = {
    ("get", "/v1/health"), ("get", "/v1/openapi.json"), ("get", "/v1/stats"), ("get", "/v1/jobs"),
    ("get", "/v1/jobs/{job}"), ("delete", "/v1/jobs/{job}"), ("post", "/v1/jobs/{job}/retain"),
    ("post", V), ("delete", V), ("post", f"{V}/commit"), ("get", f"{V}/manifest"), ("get", f"{V}/blobs"),
    ("get", f"{V}/blobs/{{name}}"), ("put", f"{V}/blobs/{{name}}"), ("post", f"{V}/blobs/{{name}}/allocate"),
    ("post", f"{V}/blobs/{{name}}/seal"), ("post", f"{V}/read"), ("post", f"{V}/locate"),
    ("post", f"{V}/allocate"), ("post", f"{V}/seal"),
    ("post", "/v1/release"), ("post", "/v1/relay"), ("post", "/v1/relay/drop"), ("post", "/v1/peers"),
    ("post", "/v1/hello"), ("post", "/v1/auth"), ("get", "/v1/local"),
    ("get", "/v1/datasets"),
    ("post", "/v1/datasets/{job}"), ("get", "/v1/datasets/{job}"), ("delete", "/v1/datasets/{job}"),
    ("post", "/v1/datasets/{job}/ids"), ("post", "/v1/datasets/{job}/read"),
}  # fmt: skip


def test_the_api_describes_itself_as_openapi(store):
    c = store.client()
    doc = c.request("GET", "/v1/openapi.json")
    assert doc["openapi"].startswith("3.1")
    ops = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert ops == PROTOCOL_V1
    for method, path in sorted(PROTOCOL_V1):  # each documented operation is served, not "no such endpoint"
        concrete = path.format(job="openapi-probe", step=7, name="nope")
        try:
            c.request(method.upper(), concrete, {} if method in ("post", "put") else None)
        except (NotFoundError, BadRequestError, ConflictError, AuthError) as e:  # /v1/auth: no challenge
            assert "no such endpoint" not in str(e) and "not allowed" not in str(e), (method, path, e)
    with pytest.raises(NotFoundError, match="no such endpoint"):  # the probe can tell
        c.request("GET", "/v1/jobs/openapi-probe/versions/7/nothing")
    with pytest.raises(BadRequestError, match="not allowed"):
        c.request("PUT", "/v1/health", {})
    commit = doc["paths"][f"{V}/commit"]["post"]
    assert [p["name"] for p in commit["parameters"]] == ["job", "step"] and "atomically" in commit["summary"]
    read = doc["paths"][f"{V}/read"]["post"]
    assert "application/octet-stream" in read["responses"]["200"]["content"]
    put = doc["paths"][f"{V}/blobs/{{name}}"]["put"]
    assert "application/octet-stream" in put["requestBody"]["content"]
    c.delete_job("openapi-probe")


def test_a_stores_ready_line_is_found_after_half_a_line_left_by_a_killed_one():
    from tenplex.store.process import announced

    assert announced("tenplex store listening on http://127.0.0.1:7 (pid 42)\n") == ("http://127.0.0.1:7", 42)
    assert announced("Traceback (most rectenplex store listening on http://h:8 (pid 9)") == ("http://h:8", 9)
    assert announced("tenplex store listening on http://h:8\n") == ("http://h:8", None)
    assert announced("some other line\n") is None and announced("tenplex store listening on ") is None


def test_a_blob_larger_than_every_pooled_file_takes_the_pages_of_smaller_ones(request):
    """A layout with fewer, bigger shards: no pooled file is large enough, so the oldest smaller ones are
    freed right before the new file is made (their pages, already backed, go to it) instead of sitting in
    the pool while it takes fresh ones; the new blob reads back whole, the still-needed blob is untouched."""
    job = job_name(request)
    with start_store(memory_limit="32MiB") as sp:
        c, net = sp.client(local=True), sp.client(local=False)
        keep = sample("float32", (1 << 18,), 1)
        c.write_blob(job, 0, "keep", keep)
        c.commit(job, 0, None)
        for i in range(3):
            c.write_blob(job, 1, f"s{i}", np.full(1 << 18, i, np.float32))  # 1 MiB each
        c.commit(job, 1, None)
        old = {blob_path(c, job, 1, f"s{i}") for i in range(3)}
        c.delete_version(job, 1)
        assert c.stats()["memory_pooled"] == 3 << 20
        big = sample("float32", (3 << 18,), 2)  # 3 MiB: larger than every pooled file
        c.write_blob(job, 2, "big", big)
        c.commit(job, 2, None)
        assert c.stats()["memory_pooled"] == 0 and blob_path(c, job, 2, "big") not in old
        assert not any(os.path.exists(p) for p in old)
        for reader in (c, net):
            got, kept = np.empty_like(big), np.empty_like(keep)
            reader.read_box(job, 2, "big", Box((0,), big.shape), got)
            reader.read_box(job, 0, "keep", Box((0,), keep.shape), kept)
            np.testing.assert_array_equal(got, big)
            np.testing.assert_array_equal(kept, keep)
        c.delete_job(job)


def test_a_store_tied_to_a_script_goes_with_its_memory_when_the_script_crashes(tmp_path):
    """Found by a profiling script that raised before stopping its store: the store (and its shared
    memory) stayed up after the script was gone. Stores started with a `log` outlive their starter by
    design (the runtime's); `start_store()` without one belongs to its starter."""
    script = (
        "import os, sys\n"
        "from tenplex.store import start_store\n"
        "sp = start_store(memory_limit='8MiB')\n"
        "c = sp.client()\n"
        "import numpy as np\n"
        "c.write_blobs('j', 1, [('w', np.ones(1000), None)])\n"
        "print(sp.proc.pid, sp.shm_dir, flush=True)\n"
        "os._exit(1)  # no stop, no atexit: as a crash leaves it\n"
    )
    with open(tmp_path / "err", "w") as err:  # not a pipe: a store left behind would hold it open
        done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=60)  # fmt: skip
    assert done.stdout.strip(), (tmp_path / "err").read_text()
    pid, shm = done.stdout.split()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    stat = Path(f"/proc/{pid}/stat")
    gone = not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # ended, not yet reaped
    assert gone, "the store outlived the script that started it"
    assert not os.path.exists(shm), f"the store left {shm} behind"


def test_a_pooled_connection_the_store_closed_is_not_used_again(monkeypatch):
    """A store that restarted (or timed out an idle connection) closed the client's pooled connections: the
    next request takes a new one at once instead of failing on the old one and backing off to retry."""
    import tenplex.store.transport as transport

    slept: list[float] = []
    with start_store(memory_limit="16MiB") as first:
        port = int(first.url.rsplit(":", 1)[1])
        c = StoreClient(first.url, token=first.token, local=False)
        old_pid = c.health()["pid"]
        assert len(c.transport._pool) == 1
    with start_store(port=port, memory_limit="16MiB") as again:
        with monkeypatch.context() as m:  # time.sleep is the backoff between attempts (and only that here)
            m.setattr(transport.time, "sleep", slept.append)
            pid = c.health()["pid"]
        assert again.url == c.url and pid not in (old_pid, None)
    assert slept == []  # no failed attempt, so no backoff


def test_relay_fetches_of_one_save_that_start_together_list_its_blobs_once(request):
    """Four ranks' relay requests for different blobs of one save reach the store together: it lists the
    peer's blobs once for all of them (the rest of the peer's requests are the reads and the handshakes of
    new connections), and each gets its own bytes."""
    job = job_name(request)
    with start_store(memory_limit="64MiB") as remote, start_store(memory_limit="64MiB") as here:
        rc = remote.client(local=False)
        blobs = {f"w{i}": sample("float32", (64, 32), i) for i in range(4)}
        save_id = "5a7e" * 8
        rc.create_version(job, 1, save_id=save_id)
        rc.write_blobs(job, 1, [(n, a, None) for n, a in blobs.items()], save_id=save_id)
        assert rc.commit(job, 1, None, save_id=save_id)["save_id"] == save_id
        before = rc.stats()
        start = threading.Barrier(len(blobs))
        outs = {n: np.empty_like(a) for n, a in blobs.items()}

        def fetch(name: str) -> None:
            c = here.client(local=False)
            start.wait()
            c.fetch_remote_many(remote.url, job, 1, [(name, None, outs[name])], save_id)

        threads = [threading.Thread(target=fetch, args=(n,)) for n in blobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        after = rc.stats()
        for n, a in blobs.items():
            np.testing.assert_array_equal(outs[n], a)
        handshakes = after["accepted"] - before["accepted"]
        # requests: one listing + one read per blob + a handshake (hello, auth) per new connection + the
        # second stats call
        assert after["requests"] - before["requests"] == 1 + len(blobs) + 2 * handshakes + 1


def test_a_kept_listing_never_lets_a_relay_answer_with_another_saves_bytes(request):
    """The relay keeps a peer's listing of a save. When the peer's step is replaced by another save with a
    blob of the same name but another shape and dtype, a request for the first save gets NotFound (not the
    new bytes), and a request for the new save gets the new bytes with their own shape."""
    job = job_name(request)
    first, second = "a1" * 16, "b2" * 16
    with start_store(memory_limit="64MiB") as remote, start_store(memory_limit="64MiB") as here:
        rc, hc = remote.client(local=False), here.client(local=False)
        old = sample("float32", (8, 8), 1)
        rc.create_version(job, 1, save_id=first)
        rc.write_blobs(job, 1, [("w", old, None)], save_id=first)
        rc.commit(job, 1, None, save_id=first)
        top = np.empty((4, 8), np.float32)
        hc.fetch_remote_many(remote.url, job, 1, [("w", Box((0, 0), (4, 8)), top)], first)  # lists the save
        np.testing.assert_array_equal(top, old[:4])
        rc.delete_version(job, 1)
        new = sample("float64", (16, 4), 2)
        rc.create_version(job, 1, save_id=second)
        rc.write_blobs(job, 1, [("w", new, None)], save_id=second)
        rc.commit(job, 1, None, save_id=second)
        with pytest.raises(NotFoundError):  # the kept listing of the first save says (8, 8) float32
            hc.fetch_remote_many(remote.url, job, 1, [("w", None, np.empty((8, 8), np.float32))], first)
        got = np.empty((16, 4), np.float64)
        hc.fetch_remote_many(remote.url, job, 1, [("w", None, got)], second)
        np.testing.assert_array_equal(got, new)
        hc.drop_relay(job, 1)


def _fds_and_maps(pid: int) -> tuple[int, int]:
    """A process's open descriptors and memory mappings (`/proc/PID/fd` entries, `/proc/PID/maps` lines)."""
    with open(f"/proc/{pid}/maps") as f:
        return len(os.listdir(f"/proc/{pid}/fd")), sum(1 for _ in f)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "local, n",
    # 20,000 on each path keep the test short (the network path writes one PUT per blob) and are past the
    # 16,384 blobs at which a descriptor and a mapping per blob ran the daemon out
    [(True, 20_000), (False, 20_000)],
    ids=["shm", "network"],
)
def test_a_save_of_many_one_element_blobs_takes_no_descriptor_or_mapping_per_blob(request, local, n):
    """An MoE model saves tens of thousands of one-element tensors: with a file (a descriptor and a
    mapping) per blob the daemon ran out of both at 16,384 blobs while 64 MiB were in use. Small blobs are
    ranges of pack files: the daemon's descriptors and mappings, and this client's, stay bounded by files
    through two saves, each read back whole and deleted."""
    job = job_name(request)
    items = [(f"moe.{i}", np.array([i], np.float32), None) for i in range(n)]
    with start_store(memory_limit="1GiB") as sp:
        c = sp.client(local=local)
        # this process's own (the suite's earlier tests load libraries): counted from here
        base = {sp.proc.pid: (0, 0), os.getpid(): _fds_and_maps(os.getpid())}
        for step in (1, 2):
            c.write_blobs(job, step, items)
            c.commit(job, step, None)
            out = np.empty((n, 1), np.float32)
            for s in range(0, n, 4096):
                part = range(s, min(n, s + 4096))
                c.read_boxes(job, step, [(f"moe.{i}", Box((0,), (1,)), out[i]) for i in part])
            assert (out[:, 0] == np.arange(n, dtype=np.float32)).all()
            assert c.stats()["memory_used"] == n * mmap.PAGESIZE  # whole pages, as files took
            for pid, (fds0, maps0) in base.items():
                fds, maps = _fds_and_maps(pid)
                assert fds - fds0 < 1000 and maps - maps0 < 1000, (pid, fds, maps, fds0, maps0)
            c.delete_version(job, step)


LONGEST = "模" * 340 + "😀"  # 1,024 bytes of UTF-8 (1,020 + 4): the longest valid blob name
assert len(LONGEST.encode()) == 1024


def test_the_longest_blob_name_works_on_every_route_and_one_byte_more_is_a_bad_request():
    """Names are limited in UTF-8 bytes so that the longest one, percent-encoded, fits the request line of
    every route: 1,024 characters of CJK passed validation but failed over the network and in replication
    (413, request line over 8 KiB). Over shared memory, network PUT, replication to a peer, network and
    replica reads, and the relay; one byte more is the same 400 from the client and from the daemon."""
    other = LONGEST[:-1] + "😁"
    arr = np.arange(10, dtype=np.float32)
    with start_store() as a, start_store() as b:
        a.client().set_peers([a.url, b.url], 1)
        shm, net, replica, relay = (
            a.client(local=True),
            a.client(local=False),
            b.client(local=False),
            b.client(),
        )
        shm.write_blob("names", 1, LONGEST, arr)
        net.write_blob("names", 1, other, arr + 1)
        assert shm.commit("names", 1, None, wait_replicas=True)["replication"] == "done"
        for name, want in ((LONGEST, arr), (other, arr + 1)):
            assert net.blob_info("names", 1, name)["copies"] == [a.url, b.url]
            for read in (shm.read_box, net.read_box, replica.read_box):
                out = np.empty_like(arr)
                read("names", 1, name, Box.full(arr.shape), out)
                assert (out == want).all()
            out = np.empty_like(arr)
            relay.fetch_remote(a.url, "names", 1, name, None, out)
            assert (out == want).all()
        long, box, out = LONGEST + "x", Box.full(arr.shape), np.empty_like(arr)
        put = f"/v1/jobs/names/versions/2/blobs/{quote(long, safe='')}?dtype=uint8&shape=1"
        relayed = {"peer": a.url, "job": "names", "step": 1, "boxes": [{"name": long, "box": None}]}
        refused = [
            lambda: shm.write_blob("names", 2, long, arr),
            lambda: net.write_blob("names", 2, long, arr),
            lambda: shm.read_box("names", 1, long, box, out),
            lambda: net.read_box("names", 1, long, box, out),
            lambda: relay.fetch_remote(a.url, "names", 1, long, None, out),
            lambda: net.blob_info("names", 1, long),
            # the daemon, asked without the client's check: the same error
            lambda: net.request("PUT", put, body=[memoryview(b"x")]),
            lambda: net.request("POST", "/v1/jobs/names/versions/1/read", {"boxes": [{"name": long}]}),
            lambda: relay.request("POST", "/v1/relay", relayed),
        ]
        for call in refused:
            with pytest.raises(BadRequestError, match=r"\(1025 bytes\): printable, 1..1024 bytes of UTF-8$"):
                call()


def test_a_second_sigterm_does_not_cut_a_stores_cleanup_short(request):
    """Seen by `tenplex stop`: a store sent SIGTERM again while it shut down left its shared-memory
    directory behind. The first signal starts the shutdown; later ones are ignored until it is done."""
    from tenplex.store.shm import shm_root

    job = job_name(request)
    items = [(f"b{i}", np.full(256 << 10, i, np.uint8), None) for i in range(64)]  # 16 MiB in 64 files
    for delay in (0.0, 0.005, 0.02):
        sp = start_store(memory_limit="1GiB")
        sp.client().write_blobs(job, 1, items)
        shm = Path(shm_root()) / f"tenplex-{sp.url.rsplit(':', 1)[1]}-{sp.proc.pid}"
        assert shm.is_dir()
        sp.proc.send_signal(15)
        time.sleep(delay)
        if sp.proc.poll() is None:
            sp.proc.send_signal(15)
        assert sp.proc.wait(timeout=30) == 0, delay
        assert not shm.exists(), (delay, sorted(p.name for p in shm.iterdir())[:5])


def test_a_store_whose_parent_ended_while_it_started_removes_its_memory():
    """A benchmark stopped with SIGTERM during `start_store` left its store's shared-memory directory: the
    store's parent watch stopped it before the shutdown's cleanup covered its start. Here the parent is gone
    before the store starts, so the stop comes at once."""
    from tenplex.store.shm import shm_root

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    argv = [sys.executable, "-m", "tenplex.store", "--port", "0", "--memory-limit", "64MiB",
            "--huge-pages", "off", "--with-parent", str(gone.pid)]  # fmt: skip
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    assert list(Path(shm_root()).glob(f"tenplex-*-{p.pid}")) == []
