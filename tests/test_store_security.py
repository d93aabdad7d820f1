"""Tensor store hardening: silent clients, names, tokens, SIGTERM cleanup, replication and failover (the raw
hostile-input suite is test_store_hostile.py)."""

from __future__ import annotations

import os
import signal
import socket
import stat

import numpy as np
import pytest

from rawhttp import exchange, req
from tenplex.ptc import Box
from tenplex.store import AuthError, NotFoundError, StoreClient, StoreUnavailable, start_store
from tenplex.store.tmpfs import host_path

pytestmark = pytest.mark.timeout(120)
KNOWN = np.arange(100, dtype=np.float32).reshape(10, 10)


@pytest.fixture(scope="module")
def store():
    sp = start_store(memory_limit="64MiB")
    c = sp.client(local=False)
    c.write_blob("known", 1, "r0/w", KNOWN)
    c.commit("known", 1, {"ok": True})
    yield sp
    assert sp.stop() == 0


def still_fine(sp) -> None:
    for local in (True, False):
        out = np.empty((2, 10), np.float32)
        sp.client(local=local).read_box("known", 1, "r0/w", Box((3, 0), (5, 10)), out)
        np.testing.assert_array_equal(out, KNOWN[3:5])


def test_truncated_blob_body_and_silent_clients(store):
    c = store.client(local=False)
    used = c.stats()["memory_used"]
    host, port = store.url.removeprefix("http://").rsplit(":", 1)
    for _ in range(3):  # connect and say nothing / half a PUT, then vanish
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                req("PUT", "/v1/jobs/t/versions/1/blobs/x?dtype=uint8&shape=1000000", b"\0" * 1000)[:-10]
            )
        with socket.create_connection((host, int(port))):
            pass
    still_fine(store)
    assert c.stats()["memory_used"] == used
    assert 1 not in c.versions("t")


def test_names_never_become_paths(store):
    c = store.client(local=True)
    evil = ["../../../../tmp/evil", "/etc/passwd", "a/../../b", "名前/テンソル", "x" * 1024]
    for n in evil:
        c.write_blob("paths", 1, n, np.ones(3, np.int8))
    c.commit("paths", 1, None)
    assert sorted(b["name"] for b in c.blobs("paths", 1)) == sorted(evil)
    blob_files = set(os.listdir(store.shm_dir)) - {"control.sock"}  # the store's Unix socket lives there too
    assert all(f[0] in "bp" and f[1:].isdigit() for f in blob_files)  # a blob's own file, or a pack
    assert not os.path.exists("/tmp/evil")
    out = np.empty(3, np.int8)
    c.read_box("paths", 1, "../../../../tmp/evil", Box((0,), (3,)), out)
    assert (out == 1).all()
    c.delete_job("paths")


def test_token_required_off_loopback(tmp_path):
    token_file = tmp_path / "sub" / "store.token"
    with start_store(host="0.0.0.0", token_file=str(token_file)) as sp:
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert sp.client().health()["ok"]  # the helper read the token
        for bad in (None, "", "wrong", token + "x"):
            c = StoreClient(sp.url, token=bad or None, local=False)
            c.token = bad
            with pytest.raises(AuthError):
                c.health()
            with pytest.raises(AuthError):
                c.write_blob("j", 1, "x", np.zeros(10))
        status, body, _ = exchange(sp.url, req("GET", "/v1/jobs"))
        assert status == 401 and body["error"] == "unauthorized"
        good = StoreClient(sp.url, token=token, local=False)
        good.write_blob("j", 1, "x", np.arange(10.0))
        good.commit("j", 1, None)
        assert good.versions("j") == [1]
    with start_store(host="0.0.0.0", token_file=str(token_file)) as sp:  # the same token is reused
        assert StoreClient(sp.url, token=token).jobs() == []


def test_sigterm_releases_shared_memory():
    sp = start_store(memory_limit="64MiB")
    c = sp.client(local=True)
    c.write_blob("j", 1, "a", np.ones(1 << 20, np.float32))
    c.allocate_blob("j", 2, "b", "float32", (1000,))  # an unsealed one too
    assert len(os.listdir(sp.shm_dir)) == 3  # two blob files and the Unix socket
    sp.proc.send_signal(signal.SIGTERM)
    assert sp.proc.wait(10) == 0
    assert not os.path.exists(sp.shm_dir) and not os.path.exists(host_path(sp.shm_dir))
    sp.stop()


def test_replication_and_reading_from_a_replica_after_the_primary_dies():
    stores = [start_store(memory_limit="64MiB") for _ in range(3)]
    try:
        urls = [s.url for s in stores]
        for s in stores:
            assert s.client().set_peers(urls, replicas=1) == [urls[(urls.index(s.url) + 1) % 3]]
        a = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
        primary = stores[0].client(local=True)
        primary.write_blob("rep", 3, "r0/w", a)
        primary.write_blob("rep", 3, "r0/b", a[0])
        info = primary.commit("rep", 3, {"m": 1}, wait_replicas=True)
        assert info["committed"]
        assert primary.version_info("rep")[0]["replication"] == "done"
        for b in primary.blobs("rep", 3):
            assert b["copies"] == [urls[0], urls[1]]
        assert stores[2].client().versions("rep") == []  # only the next R=1 store in the ring
        stores[0].kill()
        with pytest.raises(StoreUnavailable):
            StoreClient(urls[0], retries=1).health()
        replica = stores[1].client(local=False)
        assert replica.versions("rep") == [3]
        assert replica.manifest("rep", 3) == {"m": 1}
        out = np.empty((100, 50), np.float32)
        replica.read_box("rep", 3, "r0/w", Box((100, 150), (200, 200)), out)
        np.testing.assert_array_equal(out, a[100:200, 150:200])
        assert replica.version_info("rep")[0]["replica_of"] == urls[0]
        # a commit on the replica's own data replicates onward, not back
        with pytest.raises(NotFoundError):
            stores[2].client().manifest("rep", 3)
    finally:
        for s in stores:
            s.stop()


def test_replication_in_a_ring_whose_stores_are_primaries_of_the_same_save():
    """Two hosts, each the other's replica, each holding its ranks' blobs of one save: each ends with both
    hosts' blobs, committed once as a primary, and a lost host's blobs are found on the other."""
    stores = [start_store(memory_limit="64MiB") for _ in range(2)]
    try:
        urls = [s.url for s in stores]
        for s in stores:
            s.client().set_peers(urls, replicas=1)
        a, b = (np.full((64, 8), i, np.float32) for i in (1, 2))
        ca, cb = stores[0].client(local=True), stores[1].client(local=True)
        ca.write_blob("ring", 5, "r0/w", a)
        cb.write_blob("ring", 5, "r1/w", b)
        cb.allocate_blob("ring", 5, "r9/dead", "float32", (4,))  # a dead writer's leftover on B
        manifest = {"save_id": "s", "stores": urls}
        ca.commit("ring", 5, manifest, wait_replicas=True, blobs=["r0/w"])  # A's copy reaches B first
        assert cb.versions("ring") == []  # ... and does not make B's version visible before B commits
        cb.commit("ring", 5, manifest, wait_replicas=True, blobs=["r1/w"])
        for c, me, other in ((ca, urls[0], urls[1]), (cb, urls[1], urls[0])):
            info = c.version_info("ring")[0]
            assert info["committed"] and info["replica_of"] is None and info["replication"] == "done"
            copies = {x["name"]: x["copies"] for x in c.blobs("ring", 5)}
            assert set(copies) == {"r0/w", "r1/w"}  # the leftover is gone, the peer's copy stayed
            mine = "r0/w" if me == urls[0] else "r1/w"
            assert copies[mine] == [me, other]
        stores[0].kill()
        out = np.empty((64, 8), np.float32)
        stores[1].client(local=False).read_box("ring", 5, "r0/w", Box.full((64, 8)), out)
        np.testing.assert_array_equal(out, a)
    finally:
        for s in stores:
            s.stop()
