"""Where a benchmark's ranks run: every rank on this machine with loopback stores, or rank r in a network
namespace host with that host's own store behind a shaped link; and the links' bandwidth, probed in the
same run."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tenplex.runtime import netns
from tenplex.util import free_port
from tenplex.util.ranks import RanksFailed, run_local

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def fs_type(path: Path) -> str:
    """The file system type of the mount `path` lives on (from /proc/mounts)."""
    best, kind = "", "?"
    p = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        inside = len(parts) > 2 and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/"))
        if inside and len(parts[1]) > len(best):
            best, kind = parts[1], parts[2]
    return kind


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 8 << 30


def run_world(spec: dict, timeout: float, world: int = 4, net=None, hosts: list[str] | None = None,
              token: str | None = None, worker: str = "reconfig_worker") -> list[list[dict]]:  # fmt: skip
    """The worker's ranks, all on the machine, or with `net` rank r inside namespace host hosts[r]."""
    port = free_port() if net is None else 29500
    master = "127.0.0.1" if net is None else net.hosts[hosts[0]].addr
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-") as out:
        e = dict(os.environ)
        e.update(
            TENPLEX_BENCH_OUT=out, TENPLEX_BENCH_SPEC=json.dumps(spec), TENPLEX_EMULATED_HOSTS="1",
            OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), str(SRC), e.get("PYTHONPATH", "")]),
        )  # fmt: skip
        per_rank, popen = None, None
        if net is not None:
            per_rank = [dict(GLOO_SOCKET_IFNAME=netns.NIC, TENPLEX_BENCH_HOST=hosts[r],
                             TENPLEX_STORE_TOKEN=token or "") for r in range(world)]  # fmt: skip
            popen = lambda r, argv, env: net.popen(hosts[r], argv, env=env)  # noqa: E731
        try:
            run_local([sys.executable, "-m", worker], world, env=e, per_rank_env=per_rank,
                      timeout=timeout, master=(master, port), popen=popen)  # fmt: skip
        except RanksFailed as err:
            raise SystemExit(f"ranks {err.failed} failed (their output is above)") from None
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


RING = """
import socket, sys, threading, time
me, nxt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
srv = socket.create_server((me, 5001))
got = []
def receive():
    c, _ = srv.accept()
    buf, k = bytearray(4 << 20), 0
    while True:
        m = c.recv_into(buf)
        if not m:
            break
        k += m
    got.append(k)
rx = threading.Thread(target=receive)
rx.start()
for _ in range(200):
    try:
        c = socket.create_connection((nxt, 5001))
        break
    except OSError:
        time.sleep(0.05)
tx = lambda: int(open("/sys/class/net/nic0/statistics/tx_bytes").read())
payload = memoryview(bytes(4 << 20))
b0, t = tx(), time.perf_counter()
for i in range(0, n, 4 << 20):
    c.sendall(payload[: min(4 << 20, n - i)])
c.close()
rx.join()
print((tx() - b0) / (time.perf_counter() - t), got[0])
"""


def ring_bandwidth(net, hosts: list[str], nbytes: int) -> dict[str, float]:
    """Wire bytes/s each host sends while every host sends `nbytes` to the next and receives from the
    previous one at the same time (both directions of every link busy, as in a reconfiguration)."""
    procs = {}
    for i, h in enumerate(hosts):
        nxt = net.hosts[hosts[(i + 1) % len(hosts)]].addr
        argv = [sys.executable, "-c", RING, net.hosts[h].addr, nxt, str(nbytes)]
        procs[h] = net.popen(h, argv, stdout=subprocess.PIPE, text=True)
    out = {}
    for h, p in procs.items():
        text, _ = p.communicate(timeout=600)
        if p.returncode != 0 or not text.strip():
            raise SystemExit(f"bandwidth probe on {h} failed")
        bw, got = text.split()
        if int(got) != nbytes:
            raise SystemExit(f"bandwidth probe on {h} received {got} of {nbytes} bytes")
        out[h] = float(bw)
    return out


def reserve_timeout(nbytes: int) -> float:
    """How long a store may take to start with `--reserve nbytes`: its first touch of that memory ran at
    0.1-0.5 GB/s on this virtual machine (the host hands out guest memory lazily)."""
    return 60 + nbytes / 50e6


def need_netns(who: str) -> None:
    why = netns.unavailable()
    if why:
        print(f"{who}: {why}", file=sys.stderr)
        raise SystemExit(2)


@contextlib.contextmanager
def token_dir() -> Iterator[tuple[Path, str]]:
    """A temporary directory holding a fresh store token in `token` (mode 0600), and the token."""
    with tempfile.TemporaryDirectory(prefix="tenplex-bench-net-") as tmp:
        token = secrets.token_urlsafe(24)
        token_file = Path(tmp) / "token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        yield Path(tmp), token


def netns_world(net, tmp: Path, token: str, spec: dict, world: int, hosts: int, reserve: list[int],
                store_memory: str, timeout: float, probe: int) -> dict:  # fmt: skip
    """`hosts` namespace hosts in `net`, each with its own store, rank r on host r * hosts // world; the
    links probed before and after the ranks ran. The ranks' results, the shaped bandwidth (bytes/s)."""
    names = [net.add_host(f"h{i}").name for i in range(hosts)]
    token_file = str(tmp / "token")
    urls = [
        net.start_store(n, token_file, str(tmp / f"store-{hosts}-{n}.log"), store_memory,
                        ["--reserve", str(r)], reserve_timeout(r))[0]
        for n, r in zip(names, reserve)
    ]  # fmt: skip
    on = [names[r * hosts // world] for r in range(world)]
    before = ring_bandwidth(net, names, probe)
    own = [urls[names.index(x)] for x in on]
    spec = {**spec, "store_a": urls[0], "store_b": urls[-1], "rank_stores": own}
    per_rank = run_world(spec, timeout, world, net, on, token)
    after = ring_bandwidth(net, names, probe)
    shaped = max(min(before.values()), min(after.values()))
    print(f"  {hosts} hosts: links {shaped * 8 / 1e9:.3f} Gbit/s (slowest host, in parallel)", flush=True)
    return {"per_rank": per_rank, "shaped_bw": shaped, "ring_GBps": {"before": before, "after": after}}
