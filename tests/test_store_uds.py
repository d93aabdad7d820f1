"""Same-host store control over the daemon's Unix socket: SO_PEERCRED instead of the token, checked both
ways (the store checks the client's uid, the client checks the store's before sending anything)."""

from __future__ import annotations

import os
import socket
import stat
import threading

import numpy as np
import pytest

from tenplex.ptc import Box
from tenplex.store import AuthError, StoreClient, start_store
from tenplex.store.daemon import Daemon, StoreConfig
from tenplex.store.protocol import connect_unix
from tenplex.store.routes import ROUTES

pytestmark = pytest.mark.timeout(60)
NOBODY = 65534
KNOWN = np.arange(60, dtype=np.float32).reshape(6, 10)


@pytest.fixture(scope="module")
def store():
    sp = start_store(memory_limit="64MiB")
    yield sp
    path = sp.client().request("GET", "/v1/local")["unix"]
    assert sp.stop() == 0
    assert not os.path.exists(path), "a stopped store leaves its socket behind"


def as_nobody(work) -> int:
    """Run `work()` (returning an exit code) in a forked child that dropped to uid nobody; its exit code."""
    pid = os.fork()
    if pid == 0:  # only sockets and os calls here: the child of a threaded process
        code = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = work()
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_same_uid_client_over_the_socket_needs_no_token_and_tcp_still_does(store):
    path = store.client().request("GET", "/v1/local")["unix"]
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
    c = StoreClient(store.url, token="")  # no token at all: only the socket can let it in
    c.write_blob("uds", 1, "r0/w", KNOWN)
    c.commit("uds", 1, {"ok": True})
    assert c.transport._unix == path
    out = np.empty((2, 10), np.float32)
    c.read_box("uds", 1, "r0/w", Box((2, 0), (4, 10)), out)
    np.testing.assert_array_equal(out, KNOWN[2:4])
    wrong = StoreClient(store.url, token="not-the-token", local=False)  # TCP: token required as before
    with pytest.raises(AuthError):
        wrong.jobs()
    assert wrong.transport._unix is None, "a client told the store is remote used the Unix socket"
    net = StoreClient(store.url, local=False)  # the token over TCP reads the same bytes
    net.read_box("uds", 1, "r0/w", Box((0, 0), (6, 10)), full := np.empty_like(KNOWN))
    np.testing.assert_array_equal(full, KNOWN)
    with pytest.raises(AuthError):  # without the socket (use_unix off) the token is required again
        t = StoreClient(store.url, token="")
        t.transport.use_unix = False
        t.jobs()
    net.delete_job("uds")


def test_another_uid_cannot_reach_the_real_socket(store):
    path = store.client().request("GET", "/v1/local")["unix"]

    def connect() -> int:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return 0

    assert as_nobody(connect) == 13  # the directory and the socket are this user's alone
    assert store.client().jobs() == []


def serve(d: Daemon) -> None:
    try:
        d.serve_forever()
    except OSError:  # closed by the test
        pass


def test_the_store_refuses_another_uid_by_its_peer_credentials(tmp_path):
    """Even with the file modes opened up, the kernel's SO_PEERCRED keeps another uid out."""
    d = Daemon(ROUTES, StoreConfig("127.0.0.1", 0, 16 << 20, "tok", shm_root=str(tmp_path)))
    threading.Thread(target=serve, args=(d,), daemon=True).start()
    d.listen_unix(str(tmp_path / "s.sock"))
    os.chmod(tmp_path, 0o711)
    os.chmod(tmp_path / "s.sock", 0o666)
    os.chdir(tmp_path)  # the child resolves the socket from here (the directories above are closed)

    def ask() -> int:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect("s.sock")
        data = b""
        while chunk := s.recv(65536):  # the store answers at once, unasked, and closes
            data += chunk
        return 41 if data.split(b" ", 2)[1:2] == [b"401"] else 1

    try:
        assert as_nobody(ask) == 41
        assert d.connection_stats()["refused"] == 1
        conn = connect_unix(str(tmp_path / "s.sock"), 10)  # this uid: served without the token
        try:
            conn.send_head("GET /v1/jobs HTTP/1.1", {"Host": "x", "Content-Length": "0"})
            status, headers = conn.read_head()
            assert status.split()[1] == "200"
            assert conn.read_json(int(headers["content-length"])) == {"jobs": []}
        finally:
            conn.close()
    finally:
        os.chdir("/")
        d.close()


def test_the_client_does_not_trust_a_socket_served_by_another_uid(store, tmp_path):
    """Someone else's socket at the store's path: nothing is sent to it, the client goes by TCP + token."""
    path = str(tmp_path / "fake.sock")
    ready_r, ready_w = os.pipe()
    got_r, got_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            os.chmod(path, 0o666)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            s.listen(8)  # the credentials a client sees are the listener's at listen(): nobody's
            os.write(ready_w, b"x")
            s.settimeout(10)
            received = 0
            for _ in range(2):
                c, _ = s.accept()
                c.settimeout(2)
                try:
                    while chunk := c.recv(65536):
                        received += len(chunk)
                except OSError:
                    pass
                c.close()
            os.write(got_w, str(received).encode())
            code = 0
        finally:
            os._exit(code)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(AuthError, match="not trusted"):
            connect_unix(path, 5)
        c = store.client()
        c.transport._unix = path  # as if the store had reported that path
        assert c.jobs() == []  # answered over TCP, with the token
        assert c.transport._unix == "", "the client kept an untrusted socket"
        assert os.read(got_r, 64) == b"0", "bytes were sent to another user's socket"
    finally:
        _, status = os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, got_r, got_w):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
