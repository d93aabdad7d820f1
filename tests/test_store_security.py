"""Tensor store hardening: silent clients, names, tokens, SIGTERM cleanup, replication and failover; the
handshake against squatters and replays, token-file checks, unauthenticated floods (the raw hostile-input
suite is test_store_hostile.py)."""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import rawhttp
from rawhttp import Squatter, exchange, req
from tenplex.ptc import Box
from tenplex.store import AuthError, NotFoundError, StoreClient, StoreUnavailable, start_store
from tenplex.store.auth import client_proof, server_proof, token_file
from tenplex.store.protocol import Conn
from tenplex.store.server import AUTH_TIMEOUT, MAX_UNAUTH
from tenplex.store.shm import map_file
from tenplex.store.tmpfs import host_path
from tenplex.store.transport import owned_dir

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


# ---------------------------------------------------------------- the handshake, tokens, floods (issue 26)

TOKEN = secrets.token_hex(32)


def hello(url: str, nonce: str, live: str | None = None) -> dict:
    """The hello answer of the store at `live` (or `url`) for `url` (a raw exchange on a new socket)."""
    data = json.dumps({"nonce": nonce, "url": url}).encode()
    return exchange(live or url, rawhttp.req("POST", "/v1/hello", data))[1]


def assert_nothing_secret(got: bytes, token: str) -> None:
    """Only hello requests reached the squatter: no token, no client proof, nothing after the hello."""
    assert token.encode() not in got
    assert b"/v1/hello" in got
    assert b"/v1/auth" not in got and b"proof" not in got and b"/v1/jobs" not in got


@pytest.mark.parametrize("kind", ["listener", "fake store", "replayed answer", "relay to a live store"])
def test_a_squatter_on_a_dead_stores_port_gets_no_secret_and_returns_nothing(tmp_path, kind):
    """A store is SIGKILLed and another process binds its port: a client that was using the store (pooled,
    proven connections) sends it nothing but a hello with a fresh nonce, and raises instead of returning
    the squatter's bytes, whether it answers 404, a made-up proof, a genuine answer recorded earlier, or
    the answer of a live store with the same token relayed to it (a proof for another URL)."""
    tf = rawhttp.write_token(tmp_path / "token", TOKEN)
    with start_store(memory_limit="64MiB", token_file=tf) as live:
        sp = start_store(memory_limit="64MiB", token_file=tf)
        c = StoreClient(sp.url, token=TOKEN, local=False, retries=1)
        c.write_blob("sq", 1, "w", KNOWN)
        c.commit("sq", 1, None)
        recorded = hello(sp.url, secrets.token_hex(16))
        sp.kill()
        port = int(sp.url.rsplit(":", 1)[1])
        answers = {
            "listener": lambda path, body: None,
            "fake store": lambda path, body: {"proof": "0" * 64, "nonce": "f" * 32, "jobs": ["sq"]},
            "replayed answer": lambda path, body: recorded,
            "relay to a live store": lambda path, body: (
                hello(live.url, body["nonce"], live=live.url) if path == "/v1/hello" else {"jobs": ["sq"]}
            ),
        }
        squatter = Squatter(port, answers[kind])
        try:
            out = np.zeros_like(KNOWN)
            with pytest.raises((AuthError, StoreUnavailable)):
                c.read_box("sq", 1, "w", Box.full(KNOWN.shape), out)
            with pytest.raises((AuthError, StoreUnavailable)):
                c.jobs()
            assert not out.any(), "bytes from the squatter were returned"
        finally:
            squatter.close()
        assert_nothing_secret(squatter.got, TOKEN)


def test_a_replayed_handshake_fails(tmp_path):
    """A recorded client proof does not authenticate another connection (its server nonce is new), nor the
    same connection twice; a hello answer is a fresh challenge each time."""
    tf = rawhttp.write_token(tmp_path / "token", TOKEN)
    with start_store(memory_limit="64MiB", token_file=tf) as sp:
        nc = secrets.token_hex(16)
        with socket.create_connection(rawhttp.addr(sp.url), timeout=10) as s:
            conn = Conn(s)
            first = post(conn, "/v1/hello", {"nonce": nc, "url": sp.url})
            assert first["proof"] == server_proof(TOKEN, nc, sp.url)
            proof = client_proof(TOKEN, first["nonce"], nc, sp.url)
            assert post(conn, "/v1/auth", {"proof": proof}) == {"ok": True}
            assert post(conn, "/v1/auth", {"proof": proof})["error"] == "unauthorized"  # once only
        with socket.create_connection(rawhttp.addr(sp.url), timeout=10) as s:
            conn = Conn(s)
            again = post(conn, "/v1/hello", {"nonce": nc, "url": sp.url})  # the same hello, replayed
            assert again["nonce"] != first["nonce"]
            assert post(conn, "/v1/auth", {"proof": proof})["error"] == "unauthorized"
        status, _, closed = exchange(sp.url, rawhttp.req("POST", "/v1/auth", json.dumps({"proof": proof})
                                                         .encode()), shut=False)  # fmt: skip
        assert status == 401 and closed


def post(conn: Conn, path: str, payload: dict) -> dict:
    data = json.dumps(payload).encode()
    conn.send_head(f"POST {path} HTTP/1.1", {"Host": "x", "Content-Length": str(len(data))}, data)
    _, headers = conn.read_head()
    return conn.read_json(int(headers["content-length"]))


def test_every_unauthenticated_request_is_401_whatever_its_path(store):
    """Known, unknown, traversal and wrong-method paths alike: 401 and closed, so nothing can be learned
    (not even which routes exist) without the token; the handshake and `/v1/local` are answered."""
    paths = [("GET", "/v1/jobs"), ("GET", "/nope"), ("GET", "/v1/../etc/passwd"), ("PATCH", "/v1/jobs"),
             ("GET", "/v1/openapi.json"), ("DELETE", "/v1/jobs/known")]  # fmt: skip
    for method, path in paths:
        status, body, closed = exchange(store.url, rawhttp.req(method, path), shut=False)
        assert (status, body["error"], closed) == (401, "unauthorized", True), (method, path)
    status, body, _ = exchange(store.url, rawhttp.req("GET", "/v1/local"))
    assert status == 200 and "unix" in body
    assert store.client(local=False).versions("known") == [1]


def test_token_files_are_checked_before_they_are_trusted(tmp_path, monkeypatch):
    """World- or group-readable, a symlink (here to an unrelated two-character file), not a regular file,
    another uid's or too short: refused with one line naming the file and the fix, by the store at start
    and by clients; generated token files pass."""
    good = rawhttp.write_token(tmp_path / "good", TOKEN)
    assert token_file(good) == TOKEN
    cases = {}
    for mode in (0o644, 0o640, 0o606):
        cases[f"mode {mode:o}"] = (
            rawhttp.write_token(tmp_path / f"m{mode:o}", TOKEN),
            f"chmod 600 {tmp_path}",
        )
        os.chmod(tmp_path / f"m{mode:o}", mode)
    other = tmp_path / "ab"
    rawhttp.write_token(other, "ab")
    (tmp_path / "link").symlink_to(other)
    cases["symlink"] = (str(tmp_path / "link"), "symlink")
    cases["short"] = (rawhttp.write_token(tmp_path / "short", "0123456789abcdef0123456789abcde"), "weak")
    cases["repetitive"] = (rawhttp.write_token(tmp_path / "aaa", "a" * 64), "weak")
    (tmp_path / "dir").mkdir(mode=0o700)
    cases["directory"] = (str(tmp_path / "dir"), "not a regular file")
    cases["another uid"] = (rawhttp.write_token(tmp_path / "nobody", TOKEN), "chown")
    os.chown(tmp_path / "nobody", 65534, 65534)
    for kind, (path, fix) in cases.items():
        with pytest.raises(AuthError, match=fix) as e:
            token_file(path)
        assert path in str(e.value) and "\n" not in str(e.value), kind
    cmd = [sys.executable, "-m", "tenplex.store", "--port", "0", "--token-file", cases["mode 644"][0]]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and f"chmod 600 {cases['mode 644'][0]}" in run.stderr, run.stderr
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TENPLEX_STORE_TOKEN", raising=False)
    made = token_file(None, create=True)  # a generated one passes its own checks
    assert made is not None and token_file(None) == made
    os.chmod(tmp_path / "home" / ".tenplex" / "store.token", 0o644)
    with pytest.raises(AuthError, match="chmod 600"):  # a client refuses it too, rather than send nothing
        StoreClient("http://127.0.0.1:1")


def test_a_flood_of_unauthenticated_connections_leaves_authenticated_clients_working(store):
    """Idle connections from 127.0.0.2 and 127.0.0.3, reconnecting whenever dropped, for a few seconds: the
    store holds at most its unauthenticated budget of them, and clients with the token (each making new
    connections, handshake included) save and read meanwhile without a failure."""
    stop = threading.Event()
    opened = [0, 0]

    def flood(k: int, source: str) -> None:
        socks: list[socket.socket] = []
        while not stop.is_set() and opened[k] < 20000:
            while len(socks) < 100 and not stop.is_set():
                try:
                    socks.append(socket.create_connection(rawhttp.addr(store.url), 2, (source, 0)))
                    opened[k] += 1
                except OSError:
                    break
            ready, _, _ = select.select(socks, [], [], 0.05)
            for s in ready:  # closed by the store (displaced, or its deadline): open another
                s.close()
                socks.remove(s)
        for s in socks:
            s.close()

    threads = [threading.Thread(target=flood, args=(k, a), daemon=True)
               for k, a in enumerate(("127.0.0.2", "127.0.0.3"))]  # fmt: skip
    for t in threads:
        t.start()
    try:
        end, rounds, most = time.monotonic() + AUTH_TIMEOUT + 2, 0, 0
        while time.monotonic() < end:
            c = StoreClient(store.url, local=False, retries=0, timeout=10)
            c.write_blob("flood", rounds + 1, "w", KNOWN)
            c.commit("flood", rounds + 1, None)
            out = np.empty_like(KNOWN)
            c.read_box("flood", rounds + 1, "w", Box.full(KNOWN.shape), out)
            assert out.tobytes() == KNOWN.tobytes()
            most = max(most, c.stats()["unauthenticated"])
            c.close()
            rounds += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert rounds >= 3 and min(opened) > 100, (rounds, opened)
    assert most <= MAX_UNAUTH
    assert store.client(local=False).stats()["displaced"] > 0
    store.client(local=False).delete_job("flood")


def test_a_client_maps_only_this_users_regular_files(tmp_path):
    """What a same-host store names (its blob directory, a blob's file) is used only when it is this user's
    or root's, and not a symlink: a squatter's answer cannot point a client at files of its choosing."""
    blob = tmp_path / "b1"
    blob.write_bytes(b"\0" * 4096)
    assert len(map_file(str(blob), 4096, writable=False)) == 4096
    (tmp_path / "link").symlink_to(blob)
    with pytest.raises(AuthError, match="symlink"):
        map_file(str(tmp_path / "link"), 4096, writable=False)
    os.chown(blob, 65534, 65534)
    with pytest.raises(AuthError, match="not a regular file of this user"):
        map_file(str(blob), 4096, writable=False)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dirlink").symlink_to(tmp_path / "dir")
    assert owned_dir(str(tmp_path / "dir")) and not owned_dir(str(tmp_path / "dirlink"))
    os.chown(tmp_path / "dir", 65534, 65534)
    assert not owned_dir(str(tmp_path / "dir"))
