"""Namespace hosts: their own addresses, isolation, shaped links, partitions, failures, teardown, stores.

Every test checks afterwards that no namespace of its run is left and that the machine's own `ip link`
shows nothing of tenplex's. Skipped, with the reason, where namespaces cannot be created.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tenplex.runtime import netns
from tenplex.runtime.netns import NetnsError, Network

WHY = netns.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.fixture
def prefix(request):
    """A prefix of this test's own; afterwards nothing with it exists, and no tenplex link in the root."""
    p = netns.prefix_for(f"test:{request.node.nodeid}:{os.getpid()}")
    yield p
    left = netns.namespaces(p)
    netns.cleanup(p)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not left, f"namespaces left behind: {left}"
    assert "tpx" not in links and "nic0" not in links, links


SEND = textwrap.dedent("""
    import socket, sys, time
    addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for _ in range(100):
        try:
            c = socket.create_connection((addr, port), timeout=float(sys.argv[4]))
            break
        except ConnectionRefusedError:
            time.sleep(0.05)
    t = time.perf_counter()
    c.sendall(bytes(n))
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    print(time.perf_counter() - t)
""")
RECV = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], int(sys.argv[2])))
    c, _ = s.accept()
    n = 0
    while True:
        d = c.recv(1 << 20)
        if not d:
            break
        n += len(d)
    c.close()
    print(n)
""")


def transfer(net: Network, src: str, dst: str, nbytes: int, port: int = 5001) -> float:
    """Seconds to send `nbytes` from host `src` to host `dst` over one TCP stream."""
    rx = net.popen(dst, [sys.executable, "-c", RECV, net.hosts[dst].addr, str(port)], stdout=subprocess.PIPE,
                   text=True)  # fmt: skip
    tx = net.run(src, [sys.executable, "-c", SEND, net.hosts[dst].addr, str(port), str(nbytes), "10"])
    assert tx.returncode == 0, tx.stderr
    assert int(rx.communicate(timeout=30)[0]) == nbytes
    return float(tx.stdout)


def test_hosts_talk_over_their_own_addresses_and_count_bytes(prefix):
    with Network(prefix) as net:
        a, b = net.add_host("h0"), net.add_host("h1")
        assert a.addr != b.addr and a.ns.startswith(prefix)
        before = net.counters("h0")
        transfer(net, "h0", "h1", 8 << 20)
        after_a, after_b = net.counters("h0"), net.counters("h1")
        assert after_a["bytes_out"] - before["bytes_out"] >= 8 << 20
        assert after_b["bytes_in"] >= 8 << 20
        assert net.describe()["h1"]["addr"] == b.addr


def test_a_host_reaches_nothing_but_the_run_s_hosts(prefix):
    """No default route, no address of the machine: a server on the machine's loopback is not reachable
    from a host (its 127.0.0.1 is its own), and only the run's subnet is routed."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    try:
        with Network(prefix) as net:
            net.add_host("h0")
            routes = net.run("h0", ["ip", "route"]).stdout
            assert "default" not in routes and netns.SUBNET in routes, routes
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
            out = net.run("h0", [sys.executable, "-c", probe])
            assert out.returncode != 0 and "Connection refused" in out.stderr
    finally:
        srv.close()


def test_shaped_link_caps_bandwidth(prefix):
    """At 0.2 Gbit/s 5 MB cannot cross faster than the shaped rate allows (25 MB/s: 0.2 s)."""
    with Network(prefix, gbps=0.2) as net:
        net.add_host("h0")
        net.add_host("h1")
        seconds = transfer(net, "h0", "h1", 5_000_000)
        assert seconds >= 0.8 * 5_000_000 / (0.2e9 / 8), seconds
        qdiscs = net.run("h1", ["tc", "qdisc", "show", "dev", netns.NIC]).stdout
        assert "tbf" in qdiscs and "rate 200Mbit" in qdiscs, qdiscs


def test_partition_cuts_a_host_off_without_killing_it_and_heal_brings_it_back(prefix):
    with Network(prefix) as net:
        net.add_host("h0")
        net.add_host("h1")
        sleeper = net.popen("h1", ["sleep", "30"])
        net.partition("h1")
        probe = f"import socket; socket.create_connection(('{net.hosts['h1'].addr}', 9), timeout=1)"
        cut = net.run("h0", [sys.executable, "-c", probe])
        assert cut.returncode != 0 and ("timed out" in cut.stderr or "unreachable" in cut.stderr), cut.stderr
        assert sleeper.poll() is None  # the host still runs
        net.heal("h1")
        transfer(net, "h0", "h1", 1 << 20)
        sleeper.kill()
        sleeper.wait()


def test_kill_host_kills_its_processes_and_deletes_its_namespace(prefix):
    with Network(prefix) as net:
        net.add_host("h0")
        net.add_host("h1")
        victim = net.popen("h1", ["sleep", "30"])
        net.kill_host("h1")
        assert victim.wait(timeout=5) == -9
        assert netns.namespaces(prefix) == sorted([f"{prefix}h0", f"{prefix}sw"])


def test_leftovers_of_a_killed_run_are_removed_at_the_next_start_and_by_the_command(prefix):
    net = Network(prefix)  # a run that is "killed": never closed
    net.add_host("h0")
    orphan = net.popen("h0", ["sleep", "30"])
    again = Network(prefix)  # the next start with the same prefix
    assert orphan.wait(timeout=5) == -9
    assert netns.namespaces(prefix) == [f"{prefix}sw"]
    again.add_host("h0")
    orphan = again.popen("h0", ["sleep", "30"])
    run_dir_prefix_cmd = [sys.executable, "-m", "tenplex.runtime.netns", "list"]
    listed = subprocess.run(run_dir_prefix_cmd, capture_output=True, text=True)
    assert f"{prefix}h0" in listed.stdout
    assert netns.cleanup(prefix) == sorted([f"{prefix}h0", f"{prefix}sw"])
    assert orphan.wait(timeout=5) == -9


def test_cleanup_command_takes_a_run_dir(tmp_path):
    p = netns.prefix_for(str(tmp_path.resolve()))
    with Network(p) as net:
        net.add_host("h0")
        out = subprocess.run([sys.executable, "-m", "tenplex.runtime.netns", "cleanup", "--run-dir",
                              str(tmp_path)], capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 0 and "removed 2 namespace(s)" in out.stdout, out
        assert netns.namespaces(p) == []


def test_without_permission_the_command_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.main(["cleanup"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "root" in err
    with pytest.raises(NetnsError, match="root"):
        Network("tpx-noroot-")


def test_bad_arguments_are_refused_before_anything_is_created():
    for kw in ({"prefix": "mine-"}, {"prefix": "tpx-a-", "gbps": 0}, {"prefix": "tpx-a-", "gbps": -1.0}):
        with pytest.raises(ValueError):
            Network(**kw)
    assert netns.namespaces("tpx-a-") == []


def test_a_store_in_a_host_needs_the_token_and_serves_other_hosts(prefix, tmp_path):
    secret = "0f" * 16 + "a1b2c3d4e5f60718"  # a token file must hold 128 bits or more, mode 0600
    token = tmp_path / "token"
    token.write_text(secret + "\n")
    token.chmod(0o600)
    with Network(prefix) as net:
        net.add_host("h0")
        net.add_host("h1")
        url, store = net.start_store("h0", str(token), str(tmp_path / "store.log"), memory_limit="64MiB")
        assert url.startswith(f"http://{net.hosts['h0'].addr}:")
        ask = textwrap.dedent(f"""
            import sys
            from tenplex.store import StoreClient, StoreError
            try:
                StoreClient({url!r}, token=sys.argv[1] or None, local=False, retries=0, timeout=5).health()
                print("ok")
            except StoreError as e:
                print(type(e).__name__)
        """)
        good = net.run("h1", [sys.executable, "-c", ask, secret])
        bad = net.run("h1", [sys.executable, "-c", ask, "wrong"])
        assert good.stdout.strip() == "ok", good.stderr
        assert bad.stdout.strip() != "ok", bad.stderr
        net.kill_host("h0")
        assert store.wait(timeout=5) == -9


def test_latency_needs_netem_and_says_so_where_the_kernel_lacks_it(prefix):
    with Network(prefix, latency_ms=2) as net:
        try:
            net.add_host("h0")
        except NetnsError as e:
            assert "netem" in str(e) and len(str(e).splitlines()) == 1
            assert netns.namespaces(prefix) == [f"{prefix}sw"]  # the half-made host is gone
        else:
            qdiscs = net.run("h0", ["tc", "qdisc", "show", "dev", netns.NIC]).stdout
            assert "netem" in qdiscs and "delay 2ms" in qdiscs, qdiscs


def test_a_host_added_after_a_failure_gets_a_new_address_and_the_dead_one_is_unreachable_at_once(prefix):
    with Network(prefix) as net:
        net.add_host("h0")
        dead = net.add_host("h1").addr
        net.kill_host("h1")
        h2 = net.add_host("h2")
        assert h2.addr != dead
        probe = f"import socket; socket.create_connection(('{dead}', 9), timeout=10)"
        out = net.run("h0", [sys.executable, "-c", probe])
        assert out.returncode != 0 and ("unreachable" in out.stderr or "No route" in out.stderr), out.stderr
        transfer(net, "h0", "h2", 1 << 20)
