"""Cross-host reads on loopback, each against raw sockets measured in the same run: where a relay's time goes.

Two stores (`--reserve`, as `bench_reconfig.py` starts them): host A holds `--ranks` x `--blobs` blobs of
`--mib-each` MiB; `--ranks` rank processes of host B each need their own blobs (the dp change over two
hosts, in small). Each row is the best of `--repeat` rounds, all ranks at once, bytes of all / the slowest
rank's time:

- raw loopback TCP, one stream per rank, from one process to another (`floors.socket_bandwidth`);
- direct: every rank reads its boxes from A itself (`read_many`, each chunk checked on arrival);
- relayed and held, what a load does for a CPU target: B fetches the boxes once (checked on arrival) and
  every rank holds them in B's memory, each checking them there before it would write
  (`hold_relayed_many`);
- the ranks' check alone: one checksum pass over the held bytes, per rank (ms).

    python benchmarks/bench_relay.py [--ranks 2] [--blobs 300] [--mib-each 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time

import numpy as np

from common import print_rows, write_results
from floors import socket_bandwidth
from tenplex.ptc import Box
from tenplex.store import StoreClient, hold_relayed_many, read_many, start_store
from tenplex.store.checksum import chunk_digests

JOB, STEP = "bench-relay", 1


def blob(rank: int, i: int) -> str:
    return f"r{rank}/t{i}"


def rank_round(mode: str, rank: int, a: str, b: str, blobs: int, each: int, start, out) -> None:
    """One rank process of one round: (seconds of its reads, seconds of a checksum pass over held bytes)."""
    box = Box.full((each // 4,))
    check = 0.0
    if mode == "direct":
        src = StoreClient(a, local=False)
        arrays = [np.ones(each // 4, np.float32) for _ in range(blobs)]  # paged in, like a target
        reads = [(src, JOB, STEP, blob(rank, i), box, arrays[i]) for i in range(blobs)]
        start.wait()
        t = time.perf_counter()
        read_many(reads)
        took = time.perf_counter() - t
    else:
        own = StoreClient(b)
        start.wait()
        t = time.perf_counter()
        holds = hold_relayed_many([(own, a, blob(rank, i), box, "float32") for i in range(blobs)], JOB, STEP)
        took = time.perf_counter() - t
        t = time.perf_counter()
        for h, _ in holds:
            for arr in h.arrays:
                chunk_digests(memoryview(arr).cast("B"))
        check = time.perf_counter() - t
        for h, _ in holds:
            h.close()
    out.put((took, check))


def run(mode: str, args: argparse.Namespace, a: str, b: str, relay: StoreClient) -> tuple[float, float]:
    """Best round's time (slowest rank) and, for the relay, the slowest rank's check in that round."""
    ctx = multiprocessing.get_context("fork")
    best = (float("inf"), 0.0)
    for _ in range(args.repeat):
        start, out = ctx.Barrier(args.ranks), ctx.Queue()
        each = args.mib_each << 20
        ps = [ctx.Process(target=rank_round, args=(mode, r, a, b, args.blobs, each, start, out))
              for r in range(args.ranks)]  # fmt: skip
        for p in ps:
            p.start()
        got = [out.get(timeout=300) for _ in ps]
        for p in ps:
            p.join(timeout=60)
        best = min(best, (max(t for t, _ in got), max(c for _, c in got)))
        if mode == "relayed":
            relay.drop_relay(JOB, STEP)  # the next round fetches again
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blobs", type=int, default=300, help="blobs per rank")
    ap.add_argument("--mib-each", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    each = args.mib_each << 20
    total = args.ranks * args.blobs * each
    reserve = ["--reserve", str(total + (64 << 20))]
    with start_store(memory_limit=f"{2 * total >> 20}MiB", extra=reserve, timeout=300) as sa, \
         start_store(memory_limit=f"{2 * total >> 20}MiB", extra=reserve, timeout=300) as sb:  # fmt: skip
        a = sa.client()
        a.create_version(JOB, STEP)
        for r in range(args.ranks):
            a.write_blobs(JOB, STEP, [(blob(r, i), np.full(each // 4, r + i, np.float32), None)
                                      for i in range(args.blobs)])  # fmt: skip
        a.commit(JOB, STEP, {"bench": "relay"})
        raw = total / socket_bandwidth(args.ranks, total)
        direct, _ = run("direct", args, sa.url, sb.url, sb.client())
        relayed, check = run("relayed", args, sa.url, sb.url, sb.client())
        raw_after = total / socket_bandwidth(args.ranks, total)
    raw = min(raw, raw_after)  # the faster of the socket probes before and after: the floor
    rows = [
        {"path": f"raw loopback TCP, {args.ranks} streams", "GB/s": total / raw / 1e9, "x_socket": 1.0},
        {"path": "direct: ranks read from A", "GB/s": total / direct / 1e9, "x_socket": raw / direct},
        {"path": "relayed through B and held", "GB/s": total / relayed / 1e9, "x_socket": raw / relayed,
         "check_ms_per_rank": check * 1e3},
    ]  # fmt: skip
    print_rows(f"{total / 1e9:.2f} GB from host A to {args.ranks} ranks of host B, best of {args.repeat}",
               rows, ["path", "GB/s", "x_socket", "check_ms_per_rank"])  # fmt: skip
    meta = {
        "ranks": args.ranks,
        "blobs_per_rank": args.blobs,
        "mib_each": args.mib_each,
        "repeat": args.repeat,
        "command": " ".join(["python", "benchmarks/bench_relay.py", *sys.argv[1:]]),
    }
    print("wrote", write_results("bench_relay", rows, meta, args.out))


if __name__ == "__main__":
    main()
