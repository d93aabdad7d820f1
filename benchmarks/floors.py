"""The machine's floors, measured by the benchmarks in the same run as what they bound: memory copies and
checksums on every core the ranks can use, and loopback TCP in one or more streams; and the interpreter's
speed, by which the fixed costs of a save and a load scale (the memcpy floor does not tell it: this VM's
memcpy and its interpreter slowed by different factors from one day to the next)."""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tenplex.store.checksum import chunk_digests, copy_hashed


def _probe(op: str, nbytes: int, repeat: int, start, results) -> None:
    """One process of `bandwidth`: its own buffers, paged in and warmed, then `repeat` timed rounds."""
    src, dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
    run = {
        "copy": lambda: np.copyto(dst, src),
        "hash": lambda: chunk_digests(memoryview(src)),
        "copy_hash": lambda: copy_hashed(memoryview(src), memoryview(dst)),  # what a save does per blob
    }[op]
    run()
    times = []
    for _ in range(repeat):
        start.wait()
        times.append(_time(run))
    results.put(times)


def bandwidth(op: str, procs: int, nbytes: int = 256 << 20, repeat: int = 9) -> float:
    """Bytes per second of `op` ("copy": `np.copyto` into paged-in memory; "hash": xxh3 of every 1 MiB
    chunk, the reader's checksum pass; "copy_hash": the save's copy, each chunk hashed right after it is
    copied) with `procs` processes at once, each on its own `nbytes`: the bytes
    of all of them / the slowest one's time, best round of `repeat`. Why several: the ranks copy at once,
    so the machine's floor is what every core together moves; one thread's figure swung between 13.4 and
    20.7 GB/s from one session to the next on this VM while two processes together held at ~22 GB/s."""
    ctx = multiprocessing.get_context("fork")  # numpy only in the children: nothing to re-import
    start, results = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_probe, args=(op, nbytes, repeat, start, results)) for _ in range(procs)]
    for p in ps:
        p.start()
    try:
        per = [results.get(timeout=300) for _ in ps]
    finally:
        for p in ps:
            p.join(timeout=60)
    return procs * nbytes / min(max(t[i] for t in per) for i in range(repeat))


def _interp_work() -> int:
    """A fixed piece of the kind of work a save's and a load's fixed phases do, written without tenplex
    (whose own code gets faster, which must not move the yardstick): a few hundred tensors' descriptions
    as JSON and pickles, parsed back and walked."""
    rows = {f"t{i}": {"shape": [i % 7 + 1, 64], "dtype": "float32",
                      "pieces": [[[0, 0], [i % 7 + 1, 32], [i % 4]], [[0, 32], [i % 7 + 1, 64], [i % 3]]]}
            for i in range(300)}  # fmt: skip
    text, total = json.dumps(rows), 0
    for _ in range(3):
        back = pickle.loads(pickle.dumps(json.loads(text), protocol=pickle.HIGHEST_PROTOCOL))
        for r in back.values():
            for a, b, holders in r["pieces"]:
                total += math.prod(y - x for x, y in zip(a, b)) * len(holders)
    return total


def interp_rate(repeat: int = 9) -> float:
    """Rounds of `_interp_work` per second on one core, best of `repeat` (each round timed alone)."""
    _interp_work()
    return 1.0 / min(_time(_interp_work) for _ in range(repeat))


STREAM_CHUNK = 4 << 20


def socket_bandwidth(streams: int = 1, nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """`streams` loopback TCP streams at once from this process to another, as between two hosts' stores
    (a relay reads over several connections): `nbytes` in all, each stream 4 MiB sendall / recv_into a
    preallocated buffer in a thread of its own, timed until the receiver confirms every stream's last byte;
    best of `repeat`. Two processes, not two threads of one: with both ends in one interpreter the figure
    fell to 1.5-1.8 GB/s in some runs of this benchmark while the stores' own transfers did not slow down."""
    part = nbytes // streams
    payload = memoryview(np.ones(part, np.uint8))
    srv = socket.create_server(("127.0.0.1", 0), backlog=streams)
    sink = multiprocessing.get_context("fork").Process(
        target=_sink, args=(srv.getsockname()[1], part, streams, repeat)
    )
    sink.start()
    times = []

    def send(conn: socket.socket) -> None:
        for i in range(0, part, STREAM_CHUNK):
            conn.sendall(payload[i : i + STREAM_CHUNK])
        if conn.recv(1) != b"k":
            raise SystemExit("socket probe: the receiver did not confirm the bytes")

    try:
        for _ in range(repeat):
            conns = [srv.accept()[0] for _ in range(streams)]
            t = time.perf_counter()
            with ThreadPoolExecutor(streams) as pool:
                list(pool.map(send, conns))
            times.append(time.perf_counter() - t)
            for c in conns:
                c.close()
    finally:
        sink.join(timeout=60)
        srv.close()
    return part * streams / min(times)


def _sink(port: int, part: int, streams: int, repeat: int) -> None:
    """The receiving end of `socket_bandwidth`: its buffers paged in before the first byte."""
    sinks = [memoryview(np.ones(part, np.uint8)) for _ in range(streams)]

    def receive(c: socket.socket, sink: memoryview) -> None:
        got = 0
        while got < part:
            n = c.recv_into(sink[got : got + STREAM_CHUNK])
            if n == 0:
                return
            got += n
        c.sendall(b"k")

    for _ in range(repeat):
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(receive, conns, sinks))
        for c in conns:
            c.close()


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(procs: int, rounds: int = 9) -> dict[str, float | list[float]]:
    """Bytes per second on `procs` cores, best of `rounds` (the socket: of about half as many). The socket:
    the best of 1 up to `procs` streams at once (one stream leaves a core idle); each count is kept, as is
    the save's copy with its checksums (copy_hash: what adding the copy's and the checksums' costs in the
    verified floor stands for)."""
    streams = [socket_bandwidth(k, repeat=max(1, rounds // 2 + 1)) for k in range(1, procs + 1)]
    bw = {op: bandwidth(op, procs, repeat=rounds) for op in ("copy", "hash", "copy_hash")}
    return {"memcpy": bw["copy"], "socket": max(streams), "socket_streams": streams, "checksum": bw["hash"],
            "copy_hash": bw["copy_hash"], "memcpy_1core": bandwidth("copy", 1, repeat=rounds),
            "interp": interp_rate(max(rounds, 5))}  # fmt: skip


def best(before: dict, after: dict) -> dict[str, float]:
    """The better of the two measurements (the machine is shared and noisy)."""
    return {k: max(before[k], after[k]) for k in ("memcpy", "socket", "checksum", "copy_hash")}


def meta(before: dict, after: dict, procs: int) -> dict:
    """The floors as a results file records them, in GB/s."""
    return {
        **{
            f"{k}_GBps{when}": [x / 1e9 for x in v] if isinstance(v, list) else v / 1e9
            for when, got in (("", before), ("_after", after))
            for k, v in got.items()
            if k not in ("memcpy_1core", "interp")
        },
        # rounds of floors._interp_work a second, before and after the cases: what the model scales the
        # fixed costs by (the cases ran between the two)
        "interp_per_s": before["interp"],
        "interp_per_s_after": after["interp"],
        "floor_cores": procs,  # memcpy, checksum and copy_hash: that many processes at once
        "memcpy_1core_GBps": max(before["memcpy_1core"], after["memcpy_1core"]) / 1e9,
    }


def shown(f: dict) -> str:
    """The floors of `measure` in a line."""
    streams = ", ".join(f"{x / 1e9:.2f}" for x in f["socket_streams"])
    return (f"memcpy {f['memcpy'] / 1e9:.2f} GB/s ({f['memcpy_1core'] / 1e9:.2f} on one core), checksums "
            f"{f['checksum'] / 1e9:.2f}, copy with checksums {f['copy_hash'] / 1e9:.2f}; loopback socket "
            f"{f['socket'] / 1e9:.2f} GB/s (1 stream and up: {streams}); interpreter {f['interp']:.0f} "
            "rounds/s")  # fmt: skip
