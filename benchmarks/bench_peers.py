"""tenplex against what users would pick instead, on the same state in one run: torchft's transports,
ByteCheckpoint and DCP.

State: the reference GPT's parameters + AdamW moments (fp32, 12 bytes a parameter) as DTensors, every tensor
Shard(0) over its mesh's shard dim (FSDP2's layout) and replicated over the other (benchmarks/peers_state.py),
with known values: every receiving rank's tensors are checked bit for bit after every transfer.

- `recovery`: a replica rejoins and takes the state of a healthy peer (HSDP, 2 replicas of a 2-way sharded
  state; ranks 0-1 healthy on host A, ranks 2-3 rejoining on host B, each from its peer r - 2):
  tenplex `load` of the healthy replica's snapshot (`save` reported apart: a periodic snapshot is already
  there when a replica fails); torchft `HTTPTransport` (0 chunks: one request, what torchft's Manager uses
  by default; and each chunk count of `--http-chunks`, the best one counting as `http_best`), the receiver
  copying what it got into its own tensors as load_state_dict does; torchft `PGTransport` on torchft's gloo
  ProcessGroup (one per pair of peers), received in place; DCP `save` on 0-1 + `load` on 2-3 through
  /dev/shm and through an fsync'd local-disk directory (its pages dropped before the load: the rejoining host
  never read them). The two hosts are two tenplex stores on loopback ports (TENPLEX_EMULATED_HOSTS=1);
  torchft's transports cross loopback TCP like tenplex's cross-host reads.
- `fsdp` (Shard(0) on 4 ranks -> 3) and `dp` (2 replicas -> 4), one host: tenplex `save` + `load`; DCP `save`
  + `load` through /dev/shm; ByteCheckpoint (`bytecheckpoint==0.0.2`, FSDP2Checkpointer / DDPCheckpointer,
  through /dev/shm) in worlds of its own under its own torch (it requires torch <= 2.5.0): a venv at
  `--bytecheckpoint-python` (default `.venv-bytecheckpoint/bin/python`, see docs/benchmarks.md); where it
  cannot run, the row says why (`bytecheckpoint_why`).
- the floor: recovery moves the state across the hosts once: bytes / loopback-socket bandwidth; resharding
  copies it twice in memory (save, load): (saved + loaded bytes) / memcpy bandwidth (benchmarks/floors.py,
  measured before and after the cases, the better counting).

Ratios (> 1: tenplex is faster), the peer's seconds / tenplex's on the same bytes: recovery `x_torchft_http`
(0 chunks), `x_torchft_http_best`, `x_pg`, `x_dcp_shm`, `x_dcp_disk` against tenplex's load (a DCP
recovery's load against it too), and the same with tenplex's and DCP's save added (`*_with_save`);
resharding `x_dcp_shm` and `x_bytecheckpoint` on save + load; `x_floor` = tenplex / floor. Every figure is
the slowest rank's, in the best of `--repeat` repetitions ("steady"); `*_first` are the first repetition's
(the first use of fresh stores, after an untimed warm-up on a tiny state).

    python benchmarks/bench_peers.py              # ~1.2 GB of state, 3 repetitions
    python benchmarks/bench_peers.py --quick      # ~0.3 GB
    # root: the recovery case on 2 and 4 namespace hosts with 2 Gbit/s NICs, plus DCP into an S3-compatible
    # server on a storage host of its own (benchmarks/peers_netns.py) -> results/bench_peers_netns.json
    sudo -E python benchmarks/bench_peers.py --network netns --nic-gbps 2 --quick
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

from bench_reconfig import SIZES, each_rep
from common import entry, print_rows, write_results
from floors import bandwidth, socket_bandwidth
from peers_bytecheckpoint import run_bytecheckpoint
from peers_netns import busiest_received, run_netns
from tenplex.ptc.gpt import GPTConfig
from tenplex.store import start_store
from worlds import available_memory, fs_type, run_world

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def recovery_row(reps: list[list[dict]], chunks: list[int], floor_s: float, torchft_why: str | None,
                 hosts: int = 2) -> dict:  # fmt: skip
    """The recovery case's row from every rank's repetitions."""
    torchft = [] if torchft_why else ["pg", *(f"http_{c}" for c in chunks)]
    row = systems(reps, ["tenplex", "tenplex_direct", "dcp_shm", "dcp_disk", "dcp_s3", *torchft])
    row.update(case="recovery", hosts=hosts, floor_s=floor_s)
    peers = {k: f"{k}_load_s" for k in ("dcp_shm", "dcp_disk", "dcp_s3") if f"{k}_load_s" in row}
    if torchft_why:
        row["torchft_why"] = torchft_why
    else:
        row["http_best_chunks"] = best = min(chunks, key=lambda c: row[f"http_{c}_s"])
        peers.update(torchft_http="http_0_s", torchft_http_best=f"http_{best}_s", pg="pg_s")
    for when, (mine, tag) in product(("", "_first"), (("tenplex", ""), ("tenplex_direct", "_direct"))):
        load = row[f"{mine}_load_s{when}"]
        with_save = load + row[f"{mine}_save_s{when}"]
        for name, key in peers.items():
            s = row[key + when]
            row[f"x_{name}{tag}{when}"] = s / load
            saved = row.get(f"{name}_save_s{when}", 0.0)  # DCP's own save before its load
            row[f"x_{name}_with_save{tag}{when}"] = (s + saved) / with_save
    row["x_floor"] = row["tenplex_load_s"] / floor_s
    row["x_floor_direct"] = row["tenplex_direct_load_s"] / floor_s
    return row


def torchft_missing() -> str | None:
    """Why torchft's transports cannot run in this environment, or None."""
    try:
        import torchft.checkpointing.http_transport
        import torchft.checkpointing.pg_transport  # noqa: F401
    except Exception as err:  # an import error or what a half-installed package raises
        why = f"{type(err).__name__}: {err}"
        return f"import torchft failed ({why}): install the peers extra (docs/benchmarks.md)"
    return None


def reshard_row(name: str, reps: list[list[dict]], floor_s: float, bcp: dict) -> dict:
    row = systems(reps, ["tenplex", "dcp_shm"])
    row.update(case=name, hosts=1, floor_s=floor_s, **bcp)
    for when in ("", "_first"):
        total = row[f"tenplex_save_s{when}"] + row[f"tenplex_load_s{when}"]
        row[f"tenplex_total_s{when}"] = total
        row[f"x_dcp_shm{when}"] = (row[f"dcp_shm_save_s{when}"] + row[f"dcp_shm_load_s{when}"]) / total
        if bcp.get(f"bytecheckpoint_save_s{when}") is not None:
            b = bcp[f"bytecheckpoint_save_s{when}"] + bcp[f"bytecheckpoint_load_s{when}"]
            row[f"x_bytecheckpoint{when}"] = b / total
    row["x_floor"] = row["tenplex_total_s"] / floor_s
    return row


def systems(reps: list[list[dict]], names: list[str]) -> dict:
    """Per system: save/load seconds (a transport's whole transfer is its `load`), best and first repetition,
    and whatever a receiving rank found wrong."""
    per_rank = reps[0]
    row: dict = {"received_GB": sum(r["dst_bytes"] for r in per_rank) / GB, "bad": []}
    for name in names:
        key = name if name.startswith("tenplex") or name.startswith("dcp") else None
        for part in ("save", "load"):
            vals = each_rep(reps, name, part)
            if not vals:
                continue
            label = f"{name}_{part}_s" if key else f"{name}_s"
            row[label], row[f"{label}_first"] = min(vals), vals[0]
        row["bad"] += sorted(
            {f"{name}: {b}" for pr in reps for r in pr for b in r.get(name, {}).get("bad", [])}
        )
    t = [r["tenplex"] for r in per_rank]
    row["saved_GB"] = sum(x.get("saved_bytes", 0) for x in t) / GB
    # where tenplex's loads spent their time (LoadInfo.phases), the slowest rank per phase, best repetition
    for mine in (n for n in names if n.startswith("tenplex")):
        loads = each_rep(reps, mine, "load")
        best = [r.get(mine, {}).get("load_phases", {}) for r in reps[loads.index(min(loads))]]
        row[f"{mine}_load_phases"] = {k: max(p.get(k, 0.0) for p in best) for k in sorted(set().union(*best))}
    return row


def floors(procs: int, nbytes: int) -> dict[str, float]:
    """memcpy and loopback-socket bytes per second (benchmarks/floors.py) on `nbytes` buffers."""
    streams = (socket_bandwidth(k, nbytes) for k in range(1, procs + 1))
    return {"memcpy": bandwidth("copy", procs, nbytes), "socket": max(streams)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full", help="state size (full ~1.2 GB)")
    p.add_argument("--quick", action="store_const", const="quick", dest="size", help="same as --size quick")
    p.add_argument("--cases", default="recovery,fsdp,dp")
    p.add_argument("--repeat", type=int, default=3, help="repetitions per case; the best one counts")
    p.add_argument("--http-chunks", default="0,2,4,8,16", help="torchft HTTPTransport chunk counts (0 first)")
    p.add_argument("--bytecheckpoint-python", default=str(ROOT / ".venv-bytecheckpoint" / "bin" / "python"))
    p.add_argument("--disk-dir", default=None, help="local-disk directory for DCP (default: the temp dir)")
    p.add_argument("--store-memory", default="8GiB")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None)
    p.add_argument("--network", choices=("loopback", "netns"), default="loopback",
                   help="hosts: loopback stores, or network namespaces (root; recovery only)")  # fmt: skip
    p.add_argument("--hosts", default="2,4", help="netns: host counts (the 4 ranks spread over them)")
    p.add_argument("--nic-gbps", type=float, default=None, help="netns: each host's NIC, each way")
    p.add_argument("--moto-python", default=str(ROOT / ".venv-moto" / "bin" / "python"),
                   help="netns: a python with moto[server] (the S3-compatible storage host)")  # fmt: skip
    args = p.parse_args()
    args.chunks = [int(c) for c in args.http_chunks.split(",")]
    if args.chunks[0] != 0:
        raise SystemExit("--http-chunks: the first count must be 0 (torchft's default, one request)")
    args.case_list = ["recovery"] if args.network == "netns" else args.cases.split(",")
    unknown = set(args.case_list) - {"recovery", "fsdp", "dp"}
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}; known: recovery, fsdp, dp")
    return args


def loopback(args, spec: dict, bw: dict) -> list[dict]:
    """Every case in one 4-rank world on two loopback stores, ByteCheckpoint's worlds after it."""
    with contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(start_store(memory_limit=args.store_memory)) for _ in range(2))
        per_rank = run_world(
            {**spec, "store_a": a.url, "store_b": b.url}, args.timeout, worker="peers_worker"
        )
    shm = Path(spec["shm_dir"])
    bcp = {c: run_bytecheckpoint(args.bytecheckpoint_python, c, spec["model"], shm, args.repeat, args.timeout)
           for c in args.case_list if c != "recovery"}  # fmt: skip
    bw.update(floors(*bw.pop("probe")))
    rows = []
    for i, name in enumerate(args.case_list):
        reps = [[r[i]["reps"][k] for r in per_rank] for k in range(args.repeat)]
        if name == "recovery":
            moved = sum(r["dst_bytes"] for r in reps[0])
            rows.append(recovery_row(reps, args.chunks, moved / bw["socket"], spec["torchft_why"]))
        else:
            st = systems(reps, ["tenplex"])
            floor_s = (st["saved_GB"] + st["received_GB"]) * GB / bw["memcpy"]
            rows.append(reshard_row(name, reps, floor_s, bcp[name]))
    return rows


def namespaces(args, spec: dict) -> list[dict]:
    """The recovery case on namespace hosts, one world per host count; the floor: the busiest rejoining
    host's bytes over its NIC's shaped rate (the token bucket's cap: nothing beats it), or without shaping
    over the link bandwidth measured in the same run. The measured rate, every host sending at once on 2
    cores, fell below the cap (1.1 of 2 Gbit/s at 4 hosts) while a transfer between two hosts ran faster."""
    hosts = [int(h) for h in args.hosts.split(",")]
    runs = run_netns(
        {**spec, "store_a": "", "store_b": ""}, hosts, args.nic_gbps, args.moto_python, args.timeout
    )
    rows = []
    for run in runs:
        reps = [[r[0]["reps"][k] for r in run["per_rank"]] for k in range(args.repeat)]
        link = args.nic_gbps * 1e9 / 8 if args.nic_gbps else run["shaped_bw"]
        floor_s = busiest_received(reps[0], run["on"]) / link
        row = recovery_row(reps, args.chunks, floor_s, spec["torchft_why"], run["hosts"])
        row["nic_gbps_measured"] = run["shaped_bw"] * 8 / GB
        rows.append(row)
    return rows


def main() -> None:
    args = parse()
    model = SIZES[args.size]
    cfg = GPTConfig(**model)
    disk_root = Path(args.disk_dir or tempfile.gettempdir())
    if fs_type(disk_root) in ("tmpfs", "ramfs"):
        raise SystemExit(f"{disk_root} is not on a disk: pass --disk-dir")
    print(f"model {model}: {cfg.param_count() * 12 / GB:.2f} GB of params + AdamW moments", flush=True)
    torchft_why = torchft_missing() if "recovery" in args.case_list else None
    if torchft_why:
        print(f"bench_peers: {torchft_why}", file=sys.stderr)
    procs = min(len(os.sched_getaffinity(0)), 4)
    probe = min(256 << 20, max(16 << 20, cfg.param_count() * 12))  # a tiny state: a quick probe
    before = floors(procs, probe) if args.network == "loopback" else {}
    disk = Path(tempfile.mkdtemp(prefix="tenplex-bench-peers-", dir=disk_root))
    shm = Path(tempfile.mkdtemp(prefix="tenplex-bench-peers-", dir="/dev/shm"))
    spec = {"model": model, "disk_dir": str(disk), "shm_dir": str(shm), "cases": args.case_list,
            "repeat": args.repeat, "http_chunks": args.chunks, "torchft": torchft_why is None,
            "torchft_why": torchft_why}  # fmt: skip
    started = time.perf_counter()
    bw = {"probe": (procs, probe)}
    try:
        rows = loopback(args, spec, bw) if args.network == "loopback" else namespaces(args, spec)
    finally:
        for d in (disk, shm):
            subprocess.run(["rm", "-rf", str(d)], check=False)
    wall = time.perf_counter() - started
    for r in rows:
        r["state_GB"] = cfg.param_count() * 12 / GB  # one copy: a replicated source holds it several times
    report(rows, args.chunks)
    meta = {"model": model, "params": cfg.param_count(), "network": args.network, "repeat": args.repeat,
            "http_chunks": args.chunks, "dcp_disk_fs": fs_type(disk_root), "wall_s": wall,
            "available_memory_GB": available_memory() / GB,
            "command": " ".join(["python", "benchmarks/bench_peers.py", *sys.argv[1:]])}  # fmt: skip
    if before:  # the floors: the better of the probes before and after the cases
        meta.update(floor_cores=procs, **{f"{k}_GBps": max(before[k], bw[k]) / GB for k in before})
    else:
        meta.update(nic_gbps=args.nic_gbps)
    name = "bench_peers" if args.network == "loopback" else "bench_peers_netns"
    path = write_results(name, rows, meta, args.out)
    print(f"wrote {path}; {wall:.0f} s for the cases")
    bad = [(r["case"], r["hosts"], r["bad"]) for r in rows if r["bad"]]
    if bad:
        print("WRONG VALUES after a transfer:", bad)
        raise SystemExit(1)


def report(rows: list[dict], chunks: list[int]) -> None:
    os.environ.setdefault("COLUMNS", "220")
    rec = [r for r in rows if r["case"] == "recovery"]
    if rec:
        print_rows("replica recovery (s, slowest rank, best repetition)", rec,
                   ["case", "hosts", "state_GB", "tenplex_save_s", "tenplex_load_s", "tenplex_direct_load_s",
                    *(f"http_{c}_s" for c in chunks), "pg_s", "dcp_shm_save_s", "dcp_shm_load_s",
                    "dcp_disk_save_s", "dcp_disk_load_s", "dcp_s3_save_s", "dcp_s3_load_s",
                    "floor_s"])  # fmt: skip
        print_rows("replica recovery: peer / tenplex load", rec,
                   ["case", "hosts", "x_torchft_http", "x_torchft_http_best", "http_best_chunks", "x_pg",
                    "x_dcp_shm", "x_dcp_disk", "x_dcp_s3", "x_floor", "x_torchft_http_first", "x_pg_first",
                    "x_dcp_shm_first", "torchft_why"])  # fmt: skip
        print_rows("replica recovery: peer / tenplex load(atomic=False)", rec,
                   ["case", "hosts", "x_torchft_http_direct", "x_torchft_http_best_direct", "x_pg_direct",
                    "x_dcp_shm_direct", "x_dcp_disk_direct", "x_dcp_s3_direct", "x_floor_direct",
                    "x_torchft_http_direct_first", "x_pg_direct_first"])  # fmt: skip
    for mine, title in (("tenplex", "tenplex load"), ("tenplex_direct", "tenplex load(atomic=False)")):
        has = [r for r in rows if f"{mine}_load_phases" in r]
        phases = sorted({k for r in has for k in r[f"{mine}_load_phases"]})
        flat = [{"case": r["case"], "hosts": r["hosts"], **r[f"{mine}_load_phases"]} for r in has]
        print_rows(f"{title} by phase (s, slowest rank per phase)", flat, ["case", "hosts", *phases])
    res = [r for r in rows if r["case"] != "recovery"]
    if res:
        print_rows("resharding save + load (s)", res,
                   ["case", "state_GB", "tenplex_save_s", "tenplex_load_s", "dcp_shm_save_s",
                    "dcp_shm_load_s", "bytecheckpoint_save_s", "bytecheckpoint_load_s", "x_dcp_shm",
                    "x_bytecheckpoint", "x_floor", "x_dcp_shm_first", "x_bytecheckpoint_first",
                    "bytecheckpoint_why"])  # fmt: skip


if __name__ == "__main__":
    entry(main)
