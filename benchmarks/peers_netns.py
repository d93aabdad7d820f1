"""bench_peers on namespace hosts (`--network netns`, root): the recovery case across shaped NICs, and DCP
into an S3-compatible object store on a storage host of its own, as a cluster's checkpoints go.

Per host count H: H namespace hosts with their own stores (rank r on host r*H/4: the healthy replica's
ranks 0-1 on the first half, the rejoining replica's 2-3 on the second), plus a storage host `st` running
moto's S3 server (its own venv, `--moto-python`), every NIC shaped to `--nic-gbps` each way. torchft's
transports reach the peer at its namespace address; DCP's shared-file-system figures (/dev/shm, disk) cross
no link (every namespace shares the machine's file systems) and stay as what they are; `dcp_s3` is DCP's
fsspec storage (s3fs) into the storage host: the save's bytes cross the healthy hosts' and the storage
host's links, the load's the storage host's and the rejoining hosts'. Nothing from the root namespace talks
to a namespace address: the readiness probe of the S3 server runs inside host h0.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tenplex.runtime import netns
from tenplex.util.tokens import read_token
from worlds import ring_bandwidth, run_world

S3_PORT = 5000
MOTO_SETUP = "python3.11 -m venv .venv-moto && .venv-moto/bin/pip install 'moto[server]==5.2.6'"
PROBE = """
import sys, time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen(sys.argv[1], timeout=2).read()
        sys.exit(0)
    except Exception:
        time.sleep(0.1)
sys.exit(1)
"""


def run_netns(spec: dict, hosts: list[int], gbps: float | None, moto: str, timeout: float) -> list[dict]:
    """One world per host count; each: the ranks' results, the measured link bandwidth and host names."""
    why = netns.unavailable()
    if why:
        raise SystemExit(f"bench_peers: {why}")
    if not Path(moto).exists():
        raise SystemExit(f"bench_peers: no moto server at {moto}: {MOTO_SETUP} (or pass --moto-python)")
    prefix = netns.prefix_for("benchmarks/bench_peers")  # a killed run's namespaces go at the next one
    probe = int(max(16 << 20, (gbps or 2.0) * 1e9 / 8))
    runs = []
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-peers-net-") as tmp:
        token_file = Path(tmp) / "token"
        token = read_token(str(token_file), create=True)
        for h in hosts:
            with netns.Network(prefix, gbps=gbps) as net:
                names = [net.add_host(f"h{i}").name for i in range(h)]
                storage = net.add_host("st")
                urls = [net.start_store(n, str(token_file), str(Path(tmp) / f"store-{h}-{n}.log"))[0]
                        for n in names]  # fmt: skip
                endpoint = start_s3(net, moto, storage.addr, names[0], Path(tmp) / f"moto-{h}.log")
                on = [names[r * h // 4] for r in range(4)]
                before = ring_bandwidth(net, [*names, "st"], probe)
                world = {**spec, "cases": ["recovery"], "rank_stores": [urls[names.index(x)] for x in on],
                         "rank_addrs": [net.hosts[x].addr for x in on], "s3": endpoint}  # fmt: skip
                per_rank = run_world(world, timeout, 4, net, on, token, worker="peers_worker")
                after = ring_bandwidth(net, [*names, "st"], probe)
            shaped = max(min(before.values()), min(after.values()))
            print(f"  {h} hosts: links {shaped * 8 / 1e9:.3f} Gbit/s (slowest host, in parallel)", flush=True)
            runs.append({"hosts": h, "per_rank": per_rank, "shaped_bw": shaped, "on": on})
    return runs


def start_s3(net, moto: str, addr: str, probe_host: str, log: Path) -> str:
    """moto's S3 server on the storage host, bound to its address; its endpoint once it answers (asked from
    inside `probe_host`: the root namespace sends nothing to namespace addresses)."""
    endpoint = f"http://{addr}:{S3_PORT}"
    with open(log, "a") as out:
        net.popen("st", [moto, "-m", "moto.server", "-H", addr, "-p", str(S3_PORT)], stdout=out,
                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    t = time.monotonic()
    ready = net.run(probe_host, [sys.executable, "-c", PROBE, endpoint], timeout=90)
    if ready.returncode != 0:
        raise SystemExit(
            f"bench_peers: moto's S3 server did not answer at {endpoint} (log: {log.read_text()[-500:]})"
        )
    print(f"  S3 server (moto) on the storage host ready in {time.monotonic() - t:.1f} s", flush=True)
    return endpoint


def busiest_received(per_rank: list[dict], on: list[str]) -> int:
    """The most bytes one rejoining host must receive (its ranks' shards): the recovery's cross-host floor."""
    by_host: dict[str, int] = {}
    for r, res in enumerate(per_rank):
        by_host[on[r]] = by_host.get(on[r], 0) + res["dst_bytes"]
    return max(by_host.values())
