"""Per-request cost of store requests over the daemon's Unix socket against loopback TCP with the token,
measured in the same run, alternating rounds: a control request (GET /v1/jobs), a blob's info, and a
one-element read over the network path (the same bytes, framed and checksummed, on either socket).

    python benchmarks/bench_store_uds.py [--n 2000] [--rounds 5] [--json results/bench_store_uds.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from tenplex.ptc import Box
from tenplex.store import StoreClient, start_store


def per_request(op: Callable[[StoreClient], object], c: StoreClient, n: int) -> float:
    op(c)
    t = time.perf_counter()
    for _ in range(n):
        op(c)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="requests per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args()
    sp = start_store(memory_limit="64MiB")
    try:
        uds = StoreClient(sp.url)
        uds.write_blob("bench", 1, "x", np.arange(1024, dtype=np.float32))
        uds.commit("bench", 1, None)
        uds.transport.local = False  # reads over the network path, on the Unix socket
        tcp = StoreClient(sp.url, local=False)
        assert uds.jobs() == tcp.jobs() and uds.transport._unix, "the Unix socket was not used"
        out = np.empty(1, np.float32)
        ops: dict[str, Callable[[StoreClient], object]] = {
            "GET /v1/jobs": lambda c: c.jobs(),
            "blob info": lambda c: c.blob_info("bench", 1, "x"),
            "1-element read": lambda c: c.read_box("bench", 1, "x", Box((7,), (8,)), out),
        }
        rows = []
        for name, op in ops.items():
            t_uds, t_tcp = [], []
            for _ in range(a.rounds):
                t_uds.append(per_request(op, uds, a.n))
                t_tcp.append(per_request(op, tcp, a.n))
            u, t = statistics.median(t_uds), statistics.median(t_tcp)
            rows.append({"op": name, "uds_us": round(u, 1), "tcp_us": round(t, 1), "x_tcp": round(t / u, 2)})
        assert out[0] == 7.0
    finally:
        sp.stop()
    print(f"{'request':<16} {'UDS µs':>8} {'TCP µs':>8} {'TCP/UDS':>8}")
    for r in rows:
        print(f"{r['op']:<16} {r['uds_us']:>8} {r['tcp_us']:>8} {r['x_tcp']:>8}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "rounds": a.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
