"""Small helpers: the scratch arena (disjoint, aligned buffers of one mapping, kept alive by their views)
and waiting for a listener."""

import gc
import socket
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenplex.util import free_port
from tenplex.util.arena import ALIGN, Arena
from tenplex.util.net import LOW_PORT, wait_listening


@given(st.lists(st.integers(0, 3 << 20), max_size=12))
def test_buffers_are_disjoint_aligned_and_exactly_sized(sizes):
    arena = Arena(Arena.size_of(sizes))
    bufs = [arena.take(n) for n in sizes]
    for i, (n, b) in enumerate(zip(sizes, bufs)):
        assert b.nbytes == n and b.ctypes.data % ALIGN == 0
        b[:] = i % 251
    for i, b in enumerate(bufs):  # no later buffer wrote over an earlier one
        assert (b == i % 251).all()


def test_taking_more_than_the_capacity_is_refused():
    arena = Arena(100)
    arena.take(64)
    with pytest.raises(ValueError, match="has 36 left, 40 asked"):
        arena.take(40)


def test_a_view_outlives_the_arena():
    view = Arena(8 << 20).take(8 << 20).view(np.float32)
    gc.collect()
    view[:] = 1.5  # the mapping is still there: the view holds it
    assert float(view.sum()) == 1.5 * view.size


def test_wait_listening_returns_once_a_late_listener_accepts():
    port = free_port()
    srv = socket.socket()

    def listen_late() -> None:
        time.sleep(0.3)
        srv.bind(("127.0.0.1", port))
        srv.listen()

    t0 = time.monotonic()
    late = threading.Thread(target=listen_late)
    late.start()
    try:
        assert wait_listening("127.0.0.1", port, timeout=10)
        assert 0.25 < time.monotonic() - t0 < 5
    finally:
        late.join()
        srv.close()


def test_wait_listening_gives_up_after_its_timeout():
    t0 = time.monotonic()
    assert not wait_listening("127.0.0.1", free_port(), timeout=0.2)
    assert time.monotonic() - t0 < 2


def test_the_collector_is_paused_inside_and_restored_after():
    from tenplex.util.collector import paused

    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        with paused():  # nested: the outer pause still holds after the inner one
            pass
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), paused():
        raise ValueError
    assert gc.isenabled()  # restored on an error too
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # a caller that turned it off keeps it off
    finally:
        gc.enable()


def test_save_and_load_never_run_a_collection(store):
    """With a threshold that sets one off at nearly every allocation, a save and a load of a small model
    run none (a full collection here took 0.17-0.53 s in the benchmark's ranks)."""
    import torch

    import tenplex

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).state_dict()
    target = {k: torch.zeros_like(v) for k, v in model.items()}
    save, load = tenplex.save, tenplex.load  # imported now (tenplex imports them on first use)
    runs: list[bool] = []  # per collection: whether save or load was running

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            runs.append(any("tenplex/transformer" in f.filename for f in traceback.extract_stack()))

    old = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(10)
    try:
        save({"model": model}, job="no-collection", step=1, store=store.url)
        load({"model": target}, job="no-collection", store=store.url)
        inside = sum(runs)
        [[] for _ in range(100)]  # and the collector works again afterwards
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(count)
    assert inside == 0 and len(runs) > 0
    for k, v in model.items():
        assert torch.equal(target[k], v)
    store.client().delete_job("no-collection")


def test_free_ports_come_from_below_the_range_outgoing_connections_take():
    """A port the kernel also gives outgoing connections could be taken before its user binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low <= LOW_PORT + 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: free_port falls back to bind(0)")
    ports = [free_port() for _ in range(50)]
    assert all(LOW_PORT <= p < low for p in ports)
    assert len(set(ports)) > 40  # drawn, not one port handed out again and again
    taken = socket.create_server(("127.0.0.1", ports[0]))
    try:
        assert ports[0] not in {free_port() for _ in range(200)}
    finally:
        taken.close()


def test_a_channel_holds_its_port_from_the_moment_its_address_is_known():
    from tenplex.runtime.channel import Channel

    channel = Channel("127.0.0.1")
    host, _, port = channel.address.rpartition(":")
    with pytest.raises(OSError), socket.create_server((host, int(port))):
        pass  # nobody else can take it while torch is still being imported
    channel.serve()
    channel.store.set("k", "v")
    assert channel.store.get("k") == b"v"
    channel.close()


def test_each_asks_every_store_at_once_and_keeps_their_order():
    from tenplex.util.parallel import each

    met = threading.Barrier(4, timeout=10)  # broken unless all four calls run at the same time

    def ask(i: int) -> int:
        met.wait()
        return i * i

    assert each(ask, range(4)) == [0, 1, 4, 9]


def test_each_raises_the_first_error_once_every_call_ended():
    from tenplex.util.parallel import each

    ended = []

    def ask(i: int) -> int:
        if i in (1, 2):
            raise ValueError(f"store {i} failed")
        time.sleep(0.05)
        ended.append(i)
        return i

    with pytest.raises(ValueError, match="store 1 failed"):
        each(ask, range(4))
    assert sorted(ended) == [0, 3]
