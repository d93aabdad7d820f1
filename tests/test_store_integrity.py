"""The store never serves foreign bytes: one save per read, replicas keyed by save, blobs held while served,
network reads checked end to end, writes that lost their version refused, dead stores' memory reclaimed.

Every test runs real daemons over real sockets; each one failed before the fix it covers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rawhttp
from conftest import serve
from launch import run_ranks
from tenplex.ptc import Box
from tenplex.store import (
    BadRequestError,
    ChecksumError,
    ConflictError,
    NotFoundError,
    StoreUnavailable,
    start_store,
)
from tenplex.store.checksum import StreamDigests, chunk_digests, cuts, digest, list_digest, span_digests
from tenplex.store.mappings import SWEEP
from tenplex.store.protocol import Conn
from tenplex.store.read_body import PREAMBLE, into
from tenplex.store.shm import shm_root
from tenplex.store.tmpfs import host_path
from tenplex.store.transport import Leased

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["files", "reserve"])
def store(request):
    """Every test of blobs held while served runs on both kinds of blob memory: files of their own (and pack
    files for small blobs), and ranges of the memory reserved at start (`slab`), which any blob may
    reuse."""
    yield from serve(["--reserve", "64MiB"] if request.param == "reserve" else None)


def _leased_path(c, job: str, step: int, name: str) -> tuple[tuple[str, int], Leased]:
    """Where a located blob is (its file and offset there), and the lease that holds it."""
    leased = c.transport.lease("POST", f"/v1/jobs/{job}/versions/{step}/locate", {"names": [name]})
    blob = leased.answer["blobs"][0]
    return (blob["path"], blob["offset"]), leased


# ---------------------------------------------------------------- 1. one save per read; replicas by save


def test_a_step_saved_twice_while_replicating_leaves_the_replica_holding_the_new_save():
    """Store D replicates to R; step 5 is committed twice (the second save replacing the first, as `save`
    does): R must end with the second save's bytes, keyed by its save id, and refuse the first's."""
    with start_store() as d, start_store() as r:
        d.client().set_peers([d.url, r.url], 1)
        cd, cr = d.client(local=False), r.client(local=False)
        for save, value in (("A", 1.0), ("B", 2.0)):
            if 5 in cd.versions("twice"):
                cd.delete_version("twice", 5)
            cd.create_version("twice", 5, save_id=save)
            cd.write_blob("twice", 5, "r1/w", np.full((64, 64), value, np.float32), save_id=save)
            info = cd.commit("twice", 5, {"save_id": save}, wait_replicas=True)
            assert info["replication"] == "done" and info["save_id"] == save
        assert cr.save_ids("twice") == {5: "B"}
        out = np.empty((64, 64), np.float32)
        cr.read_box("twice", 5, "r1/w", Box.full((64, 64)), out, save_id="B")
        assert (out == 2).all()
        assert cr.manifest("twice", 5, save_id="B") == {"save_id": "B"}
        with pytest.raises(NotFoundError, match="save A"):  # the old save's copy was replaced, not kept
            cr.read_box("twice", 5, "r1/w", Box.full((64, 64)), out, save_id="A")
        assert [b["copies"] for b in cd.blobs("twice", 5)] == [[d.url, r.url]]


@pytest.mark.dist
def test_a_step_saved_twice_then_its_store_killed_loads_one_save(tmp_path):
    """The issue's scenario with real ranks: step 5 saved twice on stores E and D, D replicating to R; D is
    SIGKILLed; the load takes D's shards from R — of the save it takes E's from, never the older one."""
    e, d, r = start_store(), start_store(), start_store()
    try:
        env = {"TENPLEX_EMULATED_HOSTS": "1", "TENPLEX_TEST_D": d.url, "TENPLEX_TEST_R": r.url,
               "TENPLEX_TEST_KILL_PID": str(d.proc.pid)}  # fmt: skip
        res = run_ranks(
            "integrity_cases", 2, env=env, per_rank_env=[{"TENPLEX_STORE": s.url} for s in (e, d)]
        )
    finally:
        for s in (e, d, r):
            s.stop()
    out = res[0]
    assert out["bad"] == [] and out["step"] == 5, out
    assert out["replica_save"] == out["primary_save"] is not None  # R copied the newer save
    assert out["lost"] == [d.url] and out["replaced"] == {d.url: r.url}, out  # D's blobs served by R


def test_replica_writes_never_touch_primaries_nor_committed_copies(store):
    c = store.client(local=False)
    job, peer = "rw", "http://127.0.0.1:9"
    c.write_blob(job, 1, "r0/w", np.full(8, 1.0, np.float32))  # own, uncommitted
    copy = np.full(8, 7.0, np.float32)
    c.create_version(job, 1, save_id="s", replica_of=peer)
    c.put_raw(job, 1, "r0/w", "float32", (8,), [memoryview(copy).cast("B")], chunk_digests(memoryview(copy)),
              replica_of=peer, save_id="s")  # fmt: skip
    c.commit(job, 1, {"save_id": "s"})
    out = np.empty(8, np.float32)
    c.read_box(job, 1, "r0/w", Box.full((8,)), out)
    assert (out == 1).all()  # the peer's copy did not replace the primary blob
    c.commit(job, 1, {"save_id": "s"}, replica_of=peer)
    with pytest.raises(ConflictError, match="committed"):  # no blob joins a committed copy
        c.put_raw(job, 1, "r0/x", "float32", (8,), [memoryview(copy).cast("B")],
                  chunk_digests(memoryview(copy)), replica_of=peer, save_id="s")  # fmt: skip
    c.create_version(job, 2, save_id="s2", replica_of="x")  # a copy is opened by its push, never by a PUT
    base = f"/v1/jobs/{job}/versions/2/blobs/r0%2Fw?dtype=float32&shape=8&replica_of=x&save_id=s2"
    body = [memoryview(copy).cast("B")]
    with pytest.raises(BadRequestError, match="digest"):  # a replica must say what its sender hashed
        c.request("PUT", base, body=body)
    with pytest.raises(ChecksumError):  # bytes other than the sender's are refused, never inserted
        c.request("PUT", base + f"&digest={list_digest([digest(memoryview(b'x'))]):016x}", body=body)
    assert next(v for v in c.version_info(job) if v["step"] == 2)["blobs"] == 0
    c.delete_job(job)


def test_a_put_in_flight_does_not_recreate_a_version_deleted_meanwhile(store):
    c = store.client(local=False)
    job = "inflight"
    c.write_blob(job, 3, "r0/a", np.zeros(4, np.float32))
    sock = rawhttp.authed(c.url, c.token)
    try:
        sock.sendall(b"PUT /v1/jobs/inflight/versions/3/blobs/r0%2Fb?dtype=uint8&shape=4000 HTTP/1.1\r\n"
                     b"Content-Length: 4000\r\n\r\n" + b"\1" * 2000)  # fmt: skip
        time.sleep(0.3)  # the daemon is receiving the body
        c.delete_version(job, 3)
        sock.sendall(b"\1" * 2000)
        answer = Conn(sock)
        status, _ = answer.read_head()
        assert status.split()[1] == "409", status
    finally:
        sock.close()
    with pytest.raises(NotFoundError):
        c.version_info(job)  # not recreated by the late write


# ---------------------------------------------------------------- 2. blobs held while served


def test_a_slow_network_read_racing_a_delete_returns_the_old_bytes_or_raises(store):
    """A network read of version 1 stalls; version 1 is deleted and version 2 (same size) written
    meanwhile. The read must return version 1's bytes (or raise), never a mix."""
    c = store.client(local=False)
    job, n = "race", 16 << 20
    c.write_blob(job, 1, "w", np.full(n, 1, np.uint8))
    c.commit(job, 1, None)
    go = threading.Event()
    out = np.zeros(n, np.uint8)
    errors: list[BaseException] = []

    def slow(conn, headers, length):
        go.wait(30)  # the daemon is blocked in send, most of the blob still to go
        return into([out])(conn, headers, length)

    def reader() -> None:
        try:
            c.request("POST", f"/v1/jobs/{job}/versions/1/read", {"boxes": [{"name": "w"}]}, reader=slow)
        except ChecksumError as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.5)
    writer = store.client(local=True)
    writer.delete_version(job, 1)
    time.sleep(2.1)  # longer than any grace period: only a reference count keeps the file from reuse
    writer.write_blob(job, 2, "w", np.full(n, 2, np.uint8))
    writer.commit(job, 2, None)
    go.set()
    t.join(60)
    assert errors or (out == 1).all(), f"{int((out == 2).sum())} bytes of version 2 in a read of version 1"
    writer.delete_job(job)


def test_a_located_blob_is_not_reused_until_its_lease_ends(store):
    """Same-host readers copy from the blob file themselves: `locate` holds the blob for the reader's
    connection, so a new blob of the same size gets another file until the reader releases it."""
    c = store.client(local=True)
    job = "lease"
    c.write_blob(job, 1, "w", np.full(1000, 1, np.int64))
    c.commit(job, 1, None)
    first, lease = _leased_path(c, job, 1, "w")
    c.delete_version(job, 1)
    c.write_blob(job, 2, "w", np.full(1000, 2, np.int64))
    c.commit(job, 2, None)
    second, lease2 = _leased_path(c, job, 2, "w")
    assert second != first  # v1's memory is still held
    with open(first[0], "rb") as f:
        f.seek(first[1])
        assert (np.frombuffer(f.read(8000), np.int64) == 1).all()
    c.transport.end_lease(lease)
    c.transport.end_lease(lease2)
    c.delete_version(job, 2)
    c.write_blob(job, 3, "w", np.full(1000, 3, np.int64))
    c.commit(job, 3, None)
    third, lease3 = _leased_path(c, job, 3, "w")
    assert third in (first, second)  # released: files are recycled again
    c.transport.end_lease(lease3)
    # a reader that dies holding a lease: its connection's close releases it
    c.transport.lease("POST", f"/v1/jobs/{job}/versions/3/locate", {"names": ["w"]}).conn.close()
    c.delete_job(job)
    deadline = time.monotonic() + 10
    while c.stats()["memory_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.stats()["memory_used"] == 0


def test_an_abandoned_writers_memory_is_never_given_to_another_blob(store):
    """A writer allocated a blob and never sealed it; its version is deleted and a new save of the same
    size written. The writer's array still maps the old memory: whatever it writes now must not reach
    the new save (a file is unlinked, a reserve range punched out and never handed out again)."""
    c = store.client(local=True)
    job, n = "abandoned-writer", 1 << 16
    stale = c.allocate_blob(job, 1, "w", "float32", (n,))
    c.delete_version(job, 1)  # dropped unsealed
    for step in (2, 3):  # the second save may take whatever the first one's deletion freed
        c.write_blob(job, step, "w", np.full(n, step, np.float32))
        c.commit(job, step, None)
    stale[:] = -1  # the abandoned writer goes on writing
    for step in (2, 3):
        out = np.empty(n, np.float32)
        c.read_box(job, step, "w", Box.full(out.shape), out)
        assert (out == step).all()
    c.delete_job(job)


def _answer(parts: list[bytes], trailer: list[int], skews: list[int]) -> tuple[bytes, int]:
    import json

    described = [{"dtype": "uint8", "nbytes": len(p), "skew": s} for p, s in zip(parts, skews)]
    meta = json.dumps({"parts": described, "digests": len(trailer)}).encode()
    raw = PREAMBLE.pack(len(meta)) + meta + b"".join(parts) + np.array(trailer, "<u8").tobytes()
    return raw, len(raw)


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def test_a_network_read_whose_bytes_differ_from_the_trailer_raises():
    """The receiver hashes what arrived and compares with the checksums the store sent after the bytes."""
    data = np.arange(3000, dtype=np.uint8).tobytes()
    good = [digest(memoryview(data)[a:b]) for a, b in cuts(len(data), 0)]
    for flip in (False, True):
        raw, n = _answer([data], good, [0])
        if flip:
            raw = raw[:100] + bytes([raw[100] ^ 1]) + raw[101:]  # one bit changed on the way
        a, b = _tcp_pair()
        try:
            a.sendall(raw)
            out = np.empty(len(data), np.uint8)
            if flip:
                with pytest.raises(ChecksumError):
                    into([out])(Conn(b), {}, n)
            else:
                into([out])(Conn(b), {}, n)
                assert out.tobytes() == data
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("flipped", [None, 0, 150, 299])
def test_one_flipped_byte_among_many_small_boxes_received_together_names_its_box(flipped):
    """Many small parts land by one scatter read before they are hashed: each part is still checked
    against its own checksum, so a byte changed on the way in any one of them fails the read, naming it."""
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 255, int(k), dtype=np.uint8).tobytes() for k in rng.integers(1, 64, 300)]
    raw, n = _answer(parts, [digest(memoryview(p)) for p in parts], [0] * len(parts))
    if flipped is not None:
        at = n - 8 * len(parts) - sum(map(len, parts[flipped:]))  # the flipped part's first byte
        raw = raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :]
    a, b = _tcp_pair()
    try:
        a.sendall(raw)
        outs = [np.empty(len(p), np.uint8) for p in parts]
        if flipped is None:
            into(outs)(Conn(b), {}, n)
            assert [o.tobytes() for o in outs] == parts
        else:
            with pytest.raises(ChecksumError, match=f"of box {flipped} "):
                into(outs)(Conn(b), {}, n)
    finally:
        a.close()
        b.close()


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_the_trailer_checksums_are_the_receivers_pieces(data):
    """Sender (stored digests for whole chunks, fresh ones at the edges; a streaming hash for gathered
    boxes) and receiver (`cuts`) agree on every piece, for any span and any slab sizes."""
    chunk = 64
    blob = np.random.default_rng(0).integers(0, 255, 1000, dtype=np.uint8).tobytes()
    stored = chunk_digests(memoryview(blob), chunk)
    lo = data.draw(st.integers(0, 1000))
    hi = data.draw(st.integers(lo, 1000))
    span = memoryview(blob)[lo:hi]
    want = [digest(span[a:b]) for a, b in cuts(hi - lo, lo % chunk, chunk)]
    assert span_digests(memoryview(blob), stored, lo, hi, chunk) == want
    sizes = data.draw(st.lists(st.integers(1, 200), max_size=20))
    s, pos = StreamDigests(chunk), 0
    for k in sizes:
        s.update(span[pos : pos + k])
        pos = min(pos + k, len(span))
    s.update(span[pos:])
    assert s.finish() == [digest(span[a:b]) for a, b in cuts(hi - lo, 0, chunk)]


def test_a_stale_writers_bytes_never_reach_a_new_blob(store):
    """Never foreign bytes: a writer keeps its mapping of a blob that was dropped unsealed (its save
    abandoned) and goes on writing garbage through it; the new blobs that follow, whichever memory they
    get (a pack range, a reserve range, a file), never see that garbage, before or after they are
    written. The dropped range is retired, never handed out again."""
    c = store.client(local=True)
    job, n = "stale", 5000  # two pages: a pack or reserve range, not a file of its own
    stale = c.allocate_blob(job, 1, "w", "uint8", (n,))
    c.delete_version(job, 1)  # the save is abandoned: the blob is dropped unsealed
    for step in (2, 3):
        stale[:] = 0xAB  # the stale writer writes through its own mapping, now and again later
        fresh = [c.allocate_blob(job, step, f"v{i}", "uint8", (n,)) for i in range(32)]
        stale[:] = 0xAB
        assert not any((a == 0xAB).any() for a in fresh), "a new blob got the stale writer's memory"
        for i, a in enumerate(fresh):
            a[:] = i
            c.seal_blob(job, step, f"v{i}")
        c.commit(job, step, None)
        stale[:] = 0xCD
        for reader in (c, store.client(local=False)):
            out = np.empty(n, np.uint8)
            for i in range(32):
                reader.read_box(job, step, f"v{i}", Box.full((n,)), out)
                assert (out == i).all()
        c.delete_version(job, step)  # sealed and released: these ranges may be reused by step 3


# ---------------------------------------------------------------- 3. leaks


def test_a_killed_stores_shared_memory_is_reaped_at_the_next_start():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = os.path.join(shm_root(), f"tenplex-1-{dead.pid}")
    alive = os.path.join(shm_root(), f"tenplex-2-{os.getpid()}")  # a running process's: kept
    os.makedirs(leftover)
    os.makedirs(alive)
    try:
        open(os.path.join(leftover, "b00000001"), "wb").close()
        with start_store():
            assert not os.path.exists(leftover)
            assert os.path.exists(alive)
    finally:
        for p in (leftover, alive):
            if os.path.isdir(p):
                os.rmdir(p) if not os.listdir(p) else None
    sp = start_store()
    sp.kill()  # what a host failure looks like: StoreProcess removes what the daemon could not
    assert not os.path.exists(sp.shm_dir)
    sp.stop()


def _mapped(path: str) -> bool:
    """Whether this process maps the file (its path as the store's own mount namespace names it)."""
    with open("/proc/self/maps") as f:
        return any(host_path(path) in line for line in f)


def test_cached_mappings_of_unlinked_blob_files_are_dropped():
    """A reader's cached mapping of a blob file keeps its memory alive after the store unlinked the file;
    the client drops such mappings the next time it maps anything. Here the file is a pack the store
    removed once it held no blob and had given its pages back to make room."""
    with start_store(memory_limit="1MiB") as sp:
        c = sp.client(local=True)
        c.write_blob("m", 1, "w", np.ones(600 << 10, np.uint8))
        c.commit("m", 1, None)
        out = np.empty(600 << 10, np.uint8)
        c.read_box("m", 1, "w", Box.full(out.shape), out)
        (path, _), lease = _leased_path(c, "m", 1, "w")
        c.transport.end_lease(lease)
        assert _mapped(path)
        c.delete_version("m", 1)
        c.write_blob("m", 2, "w", np.ones(1 << 20, np.uint8))  # a file of its own, needs the pack's room
        c.commit("m", 2, None)
        assert not os.path.exists(path)
        time.sleep(SWEEP + 0.1)  # mappings are checked every SWEEP seconds
        c.read_box("m", 2, "w", Box((0,), (10,)), np.empty(10, np.uint8))
        assert not _mapped(path)


# ---------------------------------------------------------------- 4. runtime races


def test_a_commit_waiting_longer_than_the_client_timeout_is_not_a_lost_store():
    """A replica push outlasts the committing client's socket timeout: the commit must come back (the
    push's outcome in it), not be retried into StoreUnavailable."""
    hole = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def black_hole() -> None:  # the first connection is answered never (6 s), later ones refused
        hole.settimeout(20)
        try:
            first, _ = hole.accept()
            held.append(first)
            time.sleep(6)
            first.close()
            while True:
                s, _ = hole.accept()
                s.close()
        except OSError:
            pass

    t = threading.Thread(target=black_hole, daemon=True)
    t.start()
    try:
        with start_store() as sp:
            peer = f"http://127.0.0.1:{hole.getsockname()[1]}"
            sp.client().set_peers([sp.url, peer], 1)
            c = sp.client(local=False)
            c.timeout = 1.0
            c.write_blob("slow", 1, "w", np.ones(10, np.float32))
            try:
                info = c.commit("slow", 1, {"save_id": "s"}, wait_replicas=True)
            except StoreUnavailable as e:
                pytest.fail(f"a long replica wait was taken for a lost store: {e}")
            assert info["committed"] and info["replication"].startswith("failed"), info
    finally:
        hole.close()


def test_a_second_push_of_a_step_follows_the_first_and_is_waited_for():
    """Save A of step 5 is still being pushed when save B replaces it: B's push waits for (and cancels) A's,
    and B's commit with wait_replicas returns only when the replica holds B."""
    with start_store() as d, start_store() as r:
        d.client().set_peers([d.url, r.url], 1)
        c = d.client(local=True)
        big = np.ones(24 << 20, np.uint8)
        c.create_version("push", 5, save_id="A")
        c.write_blob("push", 5, "r0/w", big, save_id="A")
        c.commit("push", 5, {"save_id": "A"})  # its push starts in the background
        c.delete_version("push", 5)
        c.create_version("push", 5, save_id="B")
        c.write_blob("push", 5, "r0/w", big[: 1 << 20] * 2, save_id="B")
        info = c.commit("push", 5, {"save_id": "B"}, wait_replicas=True)
        assert info["replication"] == "done", info
        assert r.client().save_ids("push") == {5: "B"}
        out = np.empty(1 << 20, np.uint8)
        r.client(local=False).read_box("push", 5, "r0/w", Box.full(out.shape), out, save_id="B")
        assert (out == 2).all()


def test_relayed_pieces_are_kept_per_save():
    """A relay cache entry of one save never answers a request for another save of the same step."""
    with start_store() as remote, start_store() as here:
        rc, hc = remote.client(local=False), here.client(local=False)
        out = np.empty(16, np.float32)
        for save, value in (("A", 1.0), ("B", 2.0)):
            if 4 in rc.versions("rel"):
                rc.delete_version("rel", 4)
            rc.create_version("rel", 4, save_id=save)
            rc.write_blob("rel", 4, "w", np.full(16, value, np.float32), save_id=save)
            rc.commit("rel", 4, {"save_id": save})
            hc.fetch_remote(remote.url, "rel", 4, "w", None, out, save_id=save)
            assert (out == value).all(), save
        with pytest.raises(NotFoundError):  # the remote holds B only now
            hc.fetch_remote(remote.url, "rel", 4, "w", Box((0,), (8,)), np.empty(8, np.float32), save_id="A")


def test_a_persist_racing_a_new_save_of_its_step_raises_instead_of_mixing(tmp_path, monkeypatch):
    """`persist` reads piece by piece; the step is saved again after its first piece: the DCP checkpoint
    must not take the second piece from the new save."""
    import torch

    import tenplex
    import tenplex.transformer.durable as durable
    from tenplex.transformer import StateError

    real, calls = durable._read_piece, []
    with start_store() as s:
        tenplex.save({"a": torch.zeros(4), "b": torch.zeros(4)}, job="mix", step=1, store=s.url)

        def racing(*args, **kwargs):
            real(*args, **kwargs)
            calls.append(1)
            if len(calls) == 1:  # the step is saved again (a replayed step) while persist runs
                tenplex.save({"a": torch.ones(4), "b": torch.ones(4)}, job="mix", step=1, store=s.url)

        monkeypatch.setattr(durable, "_read_piece", racing)
        with pytest.raises(StateError, match="no copy"):
            tenplex.persist("mix", 1, str(tmp_path / "dcp"), store=s.url)


def test_a_save_replaces_an_abandoned_attempt_of_another_save(store):
    """An open version of step 5 left by another save (its writer died before committing) must not block
    `tenplex.save` of step 5, nor lend it a blob: the save opens the version under its own save id, which
    replaces the abandoned one, and a load returns this save's bytes."""
    import torch

    import tenplex

    c = store.client()
    c.create_version("abandoned", 5, save_id="old")
    c.write_blob("abandoned", 5, "r0/w", np.full(4, 9, np.float32), save_id="old")
    c.write_blob("abandoned", 5, "r0/extra", np.full(4, 7, np.float32), save_id="old")
    tenplex.save({"w": torch.arange(4.0)}, "abandoned", 5, store=store.url)
    out = {"w": torch.zeros(4)}
    tenplex.load(out, "abandoned", 5, store=store.url)
    assert out["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sorted(b["name"] for b in c.blobs("abandoned", 5)) == ["r0/w"]
    c.delete_job("abandoned")
