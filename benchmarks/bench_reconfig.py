"""Reconfiguration (save + load) of the reference GPT's state against DCP, central mode and the floor.

State: the reference GPT's parameters + AdamW moments (exp_avg, exp_avg_sq) as DTensors in a (dp, tp, pp)
layout on up to 4 ranks (tp: Shard on the dims `param_shapes` gives; pp: a stage holds only its layers;
dp: replicas), plus plain values (per-parameter step, param_groups, the job step). For each change, with
1 emulated host (all ranks on one store) and 2 (ranks 0-1 on store A, 2-3 on store B,
TENPLEX_EMULATED_HOSTS=1), one 4-rank gloo world measures in the same run on the same state:

- tenplex: `save` in the source layout + `load` in the target layout; each step timed on every rank between
  barriers, the slowest rank counts; bytes by route (summed over ranks) against the plan's lower bound;
- (a) DCP `dcp.save` -> `dcp.load` through a local-disk directory (FileSystemWriter(sync_files=True): each
  file is fsync'd, then the directory), load warm (pages still cached) and cold (our files' pages dropped
  with posix_fadvise(DONTNEED) first);
- (b) DCP through /dev/shm;
- (c) central mode as the original's Tenplex-Central (`--central`: "all state is saved to, transformed on
  and loaded from one node"): every rank saves into host A's store (`save(store=A)`, over the network from
  the other hosts), then every rank loads from it (`load(central=True)`); and, as before, tenplex's own
  save followed by `load(central=True)` (only the load through host A: `x_central_load`);
- (d) the floor: (saved + kept + same-host + relayed bytes) / memcpy bandwidth + the plan's cross-host lower
  bound / raw-socket bandwidth, both measured in this run, before and after the cases, the better of the
  two counting (memcpy: `np.copyto` of 256 MiB into paged-in memory by one process per core the ranks can
  use, at once, all their bytes / the slowest one's time, best of 9 rounds; 256 MiB over loopback TCP
  from this process to a second, in 1 up to that many streams at once (the best count), 4 MiB sendall /
  recv_into preallocated buffers, best of 5; a
  run with a case faster than its floor measured the floor in a slow spell of the machine, and is written
  to a temporary file instead of results/);
- (e) the verified floor: the saved bytes at the rate of the save's own copy with checksums (each 1 MiB
  chunk hashed right after it is copied, `copy_hash_GBps`), the rest as in (d), plus every byte a load
  reads from a store (kept + same-host + relayed + cross-host) / checksum bandwidth (xxh3 of the 1 MiB
  chunks of 256 MiB of paged-in memory, `checksum_GBps`): a load writes only bytes it checked
  (docs/store.md), so its check is a pass of its own. All measured like the memcpy, on the same cores.

Before the timed cases an untimed warm-up runs the whole sequence once on a tiny model, with 1 and 2 hosts.
`--repeat N` runs each case N times (fresh job each time) and keeps the best repetition per measurement.
Every store pre-faults `--reserve` memory at start (`--store-reserve`, default: an upper bound of one
repetition's first writes into it, capped), so that no mode pays the VM's first touch of fresh pages; each
row's `paths` says whether every rank reached its own host's store through shared memory, and whether
that store keeps blobs on huge pages.

Ratios: `x_dcp_disk` = DCP disk (save + warm load) / tenplex (save + load), likewise `x_dcp_shm`,
`x_dcp_tenplex` (DCP's planner on tenplex's stores, through tenplex.dcp), `x_central` = central mode's
(save into host A + load from it) / tenplex's (save + load) and `x_central_load` = (tenplex's save + the
load through host A) / tenplex (> 1: tenplex is faster); `x_floor` = tenplex / floor (>= 1; 1 would be at
the floor), `x_floor_verified` = tenplex / the verified floor. `first_total_s`, `x_dcp_shm_first`,
`x_dcp_disk_first`: the first repetition alone, tenplex and DCP alike (what `--repeat 1` measures: a
job's first reconfiguration).

    python benchmarks/bench_reconfig.py                # ~1.2 GB of state, 2 repetitions: about 3-4 minutes
    python benchmarks/bench_reconfig.py --repeat 3     # what results/ holds (best of 3): about 4-5 minutes
    python benchmarks/bench_reconfig.py --repeat 1     # about 4 minutes
    python benchmarks/bench_reconfig.py --quick --repeat 1   # ~0.3 GB: about 2 minutes
    # the reference's tensors with 5 MB of bytes: what a save and a load cost beyond their bytes
    python benchmarks/bench_reconfig.py --size fixed --no-dcp --repeat 3 \
        --out results/bench_reconfig_fixed.json

`--network netns --nic-gbps G --hosts 2,4,8` (root): every emulated host is a network namespace
(tenplex.runtime.netns) with its own store bound to its address (token required), its ranks started
inside it and its NIC shaped to G Gbit/s each way; gloo runs across the namespaces (MASTER_ADDR = host 0,
GLOO_SOCKET_IFNAME). One world per host count: 4 ranks on 2 and 4 hosts (rank r on host r*H/4), 8 ranks
on 8 hosts (the changes with every dimension's size doubled where it holds the ranks). The cross-host
floor is the busiest host's bytes (its interface counters over the load) / the shaped bandwidth, measured
in the same run with every host sending to the next at once (wire bytes per second, the lower of the
hosts). DCP's files are on a file system every namespace host shares, so its baselines cross no link.
The cross-host part of tenplex's time, `cross_s`, is the time its cross-host bytes were in flight, taken as
the slowest rank's network phase (the longer of `network_reads` and `relayed_reads`, which run in parallel
from the start of the load's reads); `x_cross_bound` = cross_s / that floor, and `x_load_bound` = the whole
load (with choose, plan, barriers, local copies) / the floor. Central mode's save and load run one after
the other, so `central_busiest_GB` adds the busiest link's bytes of each.

    python benchmarks/bench_reconfig.py --network netns --nic-gbps 1 --hosts 2,4 --quick --repeat 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import floors
from common import entry, print_rows, write_results
from tenplex.ptc.gpt import GPTConfig
from tenplex.runtime import netns
from tenplex.store import start_store
from tenplex.util.format import human_bytes
from tenplex.util.sizes import parse_size
from worlds import (
    available_memory,
    fs_type,
    need_netns,
    netns_world,
    reserve_timeout,
    run_world,
    token_dir,
)

SIZES = {  # params + exp_avg + exp_avg_sq in fp32: 12 bytes a parameter
    "full": dict(layers=8, hidden=1024, heads=16, vocab=256, seq=1024),  # 101M params, 1.21 GB
    "half": dict(layers=8, hidden=768, heads=16, vocab=256, seq=1024),  # 57M params, 0.68 GB
    "quick": dict(layers=8, hidden=512, heads=16, vocab=256, seq=512),  # 25M params, 0.30 GB
    # the same 303 tensors with 5 MB of bytes: what a save and a load cost beyond their bytes
    "fixed": dict(layers=8, hidden=64, heads=4, vocab=256, seq=64),
}

# (dp, tp, pp). The single-dimension changes cannot keep 4 ranks on both sides (the product is the world
# size), so each doubles one dimension from 2 to 4 ranks (a scale-out: the new ranks 2-3 are host B's when
# there are 2 hosts); the combined change keeps 4 ranks and changes all three dimensions.
PAIRS = {
    "dp": ([1, 2, 1], [2, 2, 1]),
    "tp": ([1, 2, 1], [1, 4, 1]),
    "pp": ([1, 1, 2], [1, 1, 4]),
    "combined": ([1, 4, 1], [2, 1, 2]),
    # not in the default run
    "dp-in": ([2, 2, 1], [1, 2, 1]),
    "tp-in": ([1, 4, 1], [1, 2, 1]),
    "pp-in": ([1, 1, 4], [1, 1, 2]),
    "combined-replicas": ([2, 2, 1], [1, 1, 4]),
}
DEFAULT_PAIRS = "dp,tp,pp,combined"
# 8 namespace hosts, one rank each: the same changes on 8 ranks
PAIRS8 = {
    "dp": ([1, 4, 1], [2, 4, 1]),
    "tp": ([1, 4, 1], [1, 8, 1]),
    "pp": ([1, 1, 4], [1, 1, 8]),
    "combined": ([1, 8, 1], [2, 2, 2]),
    "dp-in": ([2, 4, 1], [1, 4, 1]),
}


def state_bytes(model: dict) -> int:
    """Bytes of the state: parameters and both AdamW moments in fp32."""
    return GPTConfig(**model).param_count() * 12


def store_reserves(args, state: int, cases: int, hosts: int) -> list[int]:
    """Bytes each store pre-faults at start (`--reserve`), store 0 (central mode's host) first: enough for
    every first write of one repetition, so that neither mode pays the VM's first touch of fresh memory
    (later repetitions recycle the freed files). Per case, store 0 takes its share of tenplex's save and
    relay caches (<= 2 states), central mode's whole save and its load-only variant's relay cache (2
    states); every other store its share and relay cache (<= 2 states, less with more hosts). Capped at
    half a store's memory limit and, all stores together, at half the machine's available memory."""
    if args.store_reserve != "auto":
        return [parse_size(args.store_reserve)] * hosts
    other = int(2 * state * min(1.0, 2 / hosts))
    want = [cases * 4 * state] + [cases * other] * (hosts - 1)
    cap = parse_size(args.store_memory) // 2
    want = [min(w, cap) for w in want]
    budget = available_memory() // 2
    scale = min(1.0, budget / max(1, sum(want)))
    return [int(w * scale) for w in want]


def each_rep(reps: list[list[dict]], key: str, sub: str | None = None) -> list[float]:
    """The slowest rank's seconds in each repetition."""
    out = []
    for per_rank in reps:
        vals = [(r.get(key) if sub is None else r.get(key, {}).get(sub)) for r in per_rank]
        vals = [v for v in vals if v is not None]
        if vals:
            out.append(max(vals))
    return out


def phases_of(per_rank: list[dict], kind: str) -> dict[str, float]:
    """A repetition's save or load seconds by phase, the slowest rank per phase."""
    phases = [r.get(f"{kind}_phases", {}) for r in per_rank]
    return {k: max(p.get(k, 0.0) for p in phases) for k in sorted(set().union(*phases))}


def slowest(reps: list[list[dict]], key: str, sub: str | None = None) -> float | None:
    """The slowest rank's seconds, in the best repetition."""
    return min(each_rep(reps, key, sub), default=None)


def nic_by_host(per_rank: list[dict], key: str) -> dict[str, dict]:
    """One counter reading per host (ranks on one host read the same interface)."""
    out: dict[str, dict] = {}
    for r in per_rank:
        if r.get("host") and r.get(key):
            out.setdefault(r["host"], r[key])
    return out


NIC_MEASURES = ("load", "central_save", "central", "central_local")


def busiest_link(nic: dict[str, dict]) -> int:
    """The most bytes one host's link carried in one direction."""
    return max((max(v["bytes_in"], v["bytes_out"]) for v in nic.values()), default=0)


def paths(per_rank: list[dict]) -> dict:
    """Which data paths the ranks took: each rank's own store through shared memory (the same-host path),
    and whether those stores keep blobs on huge pages."""
    seen = [r["paths"] for r in per_rank if "paths" in r]
    return {"own_store_shm": all(p["own_store_shm"] for p in seen),
            "huge_pages": all(p["huge_pages"] for p in seen)}  # fmt: skip


def central_part(row: dict, reps: list[list[dict]], shaped_bw: float | None) -> None:
    """Central mode's figures into `row` (a case that ran it)."""
    central_save, central = slowest(reps, "central_save"), slowest(reps, "central_load")
    central_local = slowest(reps, "central_local_load")
    total = row["total_s"]
    row.update(central_save_s=central_save, central_load_s=central, central_total_s=central_save + central,
               central_local_load_s=central_local, x_central=(central_save + central) / total,
               x_central_load=(row["save_s"] + central_local) / total)  # fmt: skip
    for key in ("central_save", "central_load", "central_local_load"):
        row["reps"][f"{key}_s"] = each_rep(reps, key)
    if shaped_bw:  # central mode's save and load run one after the other, so their busiest links add up
        busiest_c = sum(busiest_link(nic_by_host(reps[0], f"nic_{m}")) for m in ("central_save", "central"))
        row.update(central_busiest_GB=busiest_c / 1e9, central_bound_s=busiest_c / shaped_bw)


def summarise(ranks: list[dict], bw: dict[str, float], shaped_bw: float | None = None) -> dict:
    """One case's row; `bw`: the floors' bytes per second (memcpy, socket, checksum, copy_hash)."""
    case = ranks[0]["case"]
    reps = [[r["reps"][i] for r in ranks] for i in range(len(ranks[0]["reps"]))]
    per_rank = reps[0]
    gb = 1e9
    moved = {k: sum(r.get("bytes", {}).get(k, 0) for r in per_rank) for k in
             ("kept", "same_host", "relayed", "cross_host")}  # fmt: skip
    plan = next(r["plan_bytes"] for r in per_rank if "plan_bytes" in r)
    saved = sum(r["saved_bytes"] for r in per_rank)
    save, load = slowest(reps, "save"), slowest(reps, "load")
    total = save + load
    local = saved + moved["kept"] + moved["same_host"] + moved["relayed"]
    nic = nic_by_host(per_rank, "nic_load")
    busiest = busiest_link(nic)
    if shaped_bw:  # namespace hosts: the busiest shaped link bounds the cross-host part
        cross = busiest / shaped_bw
    else:
        cross = plan["cross_host_lower_bound"] / bw["socket"]
    floor = local / bw["memcpy"] + cross
    # verified: the save copies each chunk and hashes it while in cache (at the measured rate of doing
    # both); a load writes only bytes it checked, so every byte it reads from a store is hashed in a pass
    # of its own before the copy
    read = moved["kept"] + moved["same_host"] + moved["relayed"] + moved["cross_host"]
    floor_verified = saved / bw["copy_hash"] + (local - saved) / bw["memcpy"] + cross + read / bw["checksum"]
    row = {
        "change": case["name"],
        "src": "x".join(map(str, case["src"])),
        "dst": "x".join(map(str, case["dst"])),
        "hosts": case["hosts"],
        "state_GB": sum(r["src_bytes"] for r in per_rank) / gb,
        "saved_GB": saved / gb,
        "save_s": save,
        "load_s": load,
        "total_s": total,
        "kept_GB": moved["kept"] / gb,
        "same_host_GB": moved["same_host"] / gb,
        "relayed_GB": moved["relayed"] / gb,
        "cross_GB": moved["cross_host"] / gb,
        "cross_lb_GB": plan["cross_host_lower_bound"] / gb,
        "plan": plan,
        "floor_s": floor,
        "x_floor": total / floor,
        "floor_verified_s": floor_verified,
        "x_floor_verified": total / floor_verified,
        "reps": {"save_s": each_rep(reps, "save"), "load_s": each_rep(reps, "load")},
        "paths": paths(per_rank),
        "bad": sorted({b for pr in reps for r in pr for k in ("bad", "bad_central") for b in r.get(k, [])}),
    }
    if any("central_save" in r for r in per_rank):
        central_part(row, reps, shaped_bw)
    reps_load = each_rep(reps, "load")
    best = min(range(len(reps)), key=lambda i: each_rep(reps, "save")[i] + reps_load[i])
    for kind in ("save", "load"):  # seconds by phase: the slowest rank per phase, best and first repetition
        row[f"{kind}_phases"] = phases_of(reps[best], kind)
        row[f"{kind}_phases_first"] = phases_of(reps[0], kind)
    if shaped_bw:
        # the cross-host part: the time the cross-host bytes were in flight, taken as the slowest rank's
        # network phase (network_reads and relayed_reads run in parallel from the start of `reads`, so the
        # longer of the two), in the same repetition as the breakdown
        cross = max(max(r.get("load_phases", {}).get(k, 0.0) for k in ("network_reads", "relayed_reads"))
                    for r in reps[best])  # fmt: skip
        bound = busiest / shaped_bw
        counters = {m: nic_by_host(per_rank, f"nic_{m}") for m in NIC_MEASURES}
        row.update(
            nic_gbps_measured=shaped_bw * 8 / 1e9,
            busiest_GB=busiest / gb,
            cross_bound_s=bound,
            cross_s=cross,
            x_cross_bound=cross / bound if busiest else None,
            x_load_bound=reps_load[best] / bound if busiest else None,
            nic={h: {m: by[h] for m, by in counters.items() if h in by} for h in sorted(nic)},
        )
    # the first repetition alone (what `--repeat 1` measures: a job's first reconfiguration), baselines too
    first = each_rep(reps, "save")[0] + reps_load[0]
    row["first_total_s"] = first
    for kind in ("dcp_disk", "dcp_shm", "dcp_tenplex"):
        if not any(kind in r for r in per_rank):
            continue
        s, ld = slowest(reps, kind, "save"), slowest(reps, kind, "load")
        row[f"{kind}_save_s"], row[f"{kind}_load_s"], row[f"{kind}_total_s"] = s, ld, s + ld
        row[f"x_{kind}"] = (s + ld) / total
        row[f"x_{kind}_first"] = (each_rep(reps, kind, "save")[0] + each_rep(reps, kind, "load")[0]) / first
        row["reps"][f"{kind}_save_s"] = each_rep(reps, kind, "save")
        row["reps"][f"{kind}_load_s"] = each_rep(reps, kind, "load")
        row["bad"] += sorted(
            {f"{kind}: {b}" for pr in reps for r in pr for b in r.get(kind, {}).get("bad", [])}
        )
        if kind == "dcp_disk":
            cold = slowest(reps, kind, "load_cold")
            row["dcp_disk_load_cold_s"] = cold
            row["x_dcp_disk_cold"] = (s + cold) / total
    return row


# the Fig. 14-like table (scripts/tables.py prints the same columns)
NETNS_COLUMNS = [
    "change", "hosts", "save_s", "load_s", "total_s", "central_save_s", "central_load_s", "central_total_s",
    "x_central", "x_central_load", "busiest_GB", "central_busiest_GB", "cross_bound_s", "central_bound_s",
    "cross_s", "x_cross_bound", "x_load_bound", "nic_gbps_measured",
]  # fmt: skip
SAVE_PHASES = ["describe", "create", "gather", "plan", "stage", "copy", "barrier", "commit"]
LOAD_PHASES = ["describe", "gather", "choose", "plan", "reads", "shm_reads", "network_reads", "relayed_reads",
               "barrier", "write", "restore", "drop_relays"]  # fmt: skip


def print_breakdown(rows: list[dict]) -> None:
    """Where save and load spend their time (tenplex's SaveHandle.phases / LoadInfo.phases)."""
    flat = [{"change": r["change"], "hosts": r["hosts"],
             **{f"s.{k}": r["save_phases"].get(k) for k in SAVE_PHASES},
             **{f"l.{k}": r["load_phases"].get(k) for k in LOAD_PHASES}} for r in rows]  # fmt: skip
    print_rows(
        "save breakdown (s, slowest rank per phase, best repetition)",
        flat,
        ["change", "hosts", *[f"s.{k}" for k in SAVE_PHASES]],
    )
    print_rows(
        "load breakdown (s; the *_reads run in parallel inside reads)",
        flat,
        ["change", "hosts", *[f"l.{k}" for k in LOAD_PHASES]],
    )


def make_cases(args, hosts: int) -> list[dict]:
    pairs = PAIRS8 if hosts > 4 else PAIRS
    missing = [n for n in args.pairs.split(",") if n not in pairs]
    if missing:
        raise SystemExit(f"unknown change(s) {missing} for {hosts} hosts; known: {', '.join(pairs)}")
    return [{"name": n, "src": pairs[n][0], "dst": pairs[n][1], "hosts": hosts, "dcp": not args.no_dcp}
            for n in args.pairs.split(",")]  # fmt: skip


def run_loopback(args, model: dict, disk: Path, shm: Path) -> dict:
    """Every case in one 4-rank world; hosts = stores A and B on loopback ports."""
    cases = [c for h in args.hosts.split(",") for c in make_cases(args, int(h)) if int(h) <= 2]
    reserve = store_reserves(args, state_bytes(model), len(cases), 2)
    print(f"  store reserves: {', '.join(human_bytes(r) for r in reserve)}", flush=True)
    with contextlib.ExitStack() as stack:  # a store that started is stopped even if the next one fails
        a, b = (stack.enter_context(start_store(memory_limit=args.store_memory, extra=["--reserve", str(r)],
                                                timeout=reserve_timeout(r))) for r in reserve)  # fmt: skip
        spec = {"model": model, "store_a": a.url, "store_b": b.url, "disk_dir": str(disk),
                "shm_dir": str(shm), "cases": cases, "repeat": args.repeat}  # fmt: skip
        return {"cases": cases, "per_rank": run_world(spec, args.timeout)}


def run_netns(args, model: dict, disk: Path, shm: Path) -> list[dict]:
    """One world per host count, every host a shaped namespace host with its own store."""
    need_netns("bench_reconfig")
    prefix = netns.prefix_for("benchmarks/bench_reconfig")  # a killed run's namespaces go at the next one
    probe = int(max(16 << 20, (args.nic_gbps or 2.0) * 1e9 / 8))  # about a second of traffic per host
    runs = []
    with token_dir() as (tmp, token):
        for h in (int(x) for x in args.hosts.split(",")):
            if h < 2:
                raise SystemExit("--network netns needs at least 2 hosts")
            world, cases = max(4, h), make_cases(args, h)
            reserve = store_reserves(args, state_bytes(model), len(cases), h)
            print(f"  {h} hosts: store reserves {', '.join(human_bytes(r) for r in reserve)}", flush=True)
            spec = {"model": model, "disk_dir": str(disk), "shm_dir": str(shm), "cases": cases,
                    "repeat": args.repeat}  # fmt: skip
            with netns.Network(prefix, gbps=args.nic_gbps, latency_ms=args.nic_latency_ms) as net:
                run = netns_world(
                    net, tmp, token, spec, world, h, reserve, args.store_memory, args.timeout, probe
                )
            runs.append({"cases": cases, **run})
    return runs


def one_vs_two_host_saves(rows: list[dict]) -> dict[str, float]:
    """Per change: the save time with every rank on one store over the same save split over two stores
    (1: one host's store takes four writers as fast as two stores take two each)."""
    saves = {(r["change"], r["hosts"]): r["save_s"] for r in rows if r.get("save_s")}
    return {c: saves[(c, 1)] / saves[(c, 2)] for c, h in saves if h == 1 and (c, 2) in saves}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full", help="state size (full ~1.2 GB)")
    p.add_argument("--quick", action="store_const", const="quick", dest="size", help="same as --size quick")
    p.add_argument("--pairs", default=DEFAULT_PAIRS, help=f"comma-separated, from {', '.join(PAIRS)}")
    p.add_argument("--hosts", default="1,2", help="emulated host counts to run")
    p.add_argument("--disk-dir", default=None, help="local-disk directory for DCP (default: the temp dir)")
    p.add_argument("--no-dcp", action="store_true", help="skip the DCP baselines")
    p.add_argument("--repeat", type=int, default=2, help="repetitions per case; the best one counts")
    p.add_argument("--store-memory", default="8GiB")
    p.add_argument("--store-reserve", default="auto",
                   help="each store's --reserve; auto: one repetition's writes")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=None)
    p.add_argument("--network", choices=("loopback", "netns"), default="loopback",
                   help="hosts as loopback stores, or as network namespaces (root)")  # fmt: skip
    p.add_argument("--nic-gbps", type=float, default=None, help="netns: each host's NIC, each way")
    p.add_argument("--nic-latency-ms", type=float, default=None, help="netns: added latency (needs netem)")
    args = p.parse_args()
    if args.network == "netns" and args.hosts == "1,2":
        args.hosts = "2,4"

    model = SIZES[args.size]
    cfg = GPTConfig(**model)
    disk_root = Path(args.disk_dir or tempfile.gettempdir())
    disk_kind = fs_type(disk_root)
    if disk_kind in ("tmpfs", "ramfs"):
        raise SystemExit(f"{disk_root} is on {disk_kind}, not a disk: pass --disk-dir")
    print(f"model {model}: {cfg.param_count() / 1e6:.1f}M params, {cfg.param_count() * 12 / 1e9:.2f} GB "
          f"of params + AdamW moments; DCP disk dir on {disk_kind}", flush=True)  # fmt: skip
    # the floor's copies and checksums run on as many cores as the ranks can use (one per rank)
    worlds = [int(h) for h in args.hosts.split(",")] if args.network == "netns" else []
    procs = min(len(os.sched_getaffinity(0)), max([4, *worlds]))  # the cores this run may use
    before = floors.measure(procs)
    print(f"floor on {procs} cores: {floors.shown(before)}", flush=True)

    disk = Path(tempfile.mkdtemp(prefix="tenplex-bench-dcp-", dir=disk_root))
    shm = Path(tempfile.mkdtemp(prefix="tenplex-bench-dcp-", dir="/dev/shm"))
    started = time.perf_counter()
    try:
        if args.network == "netns":
            runs = run_netns(args, model, disk, shm)
        else:
            runs = [run_loopback(args, model, disk, shm)]
    finally:
        for d in (disk, shm):
            subprocess.run(["rm", "-rf", str(d)], check=False)
    wall = time.perf_counter() - started
    after = floors.measure(procs)
    best = floors.best(before, after)
    rows = [
        summarise([r[i] for r in run["per_rank"]], best, run.get("shaped_bw"))
        for run in runs
        for i in range(len(run["cases"]))
    ]
    cases = [c for run in runs for c in run["cases"]]
    os.environ.setdefault("COLUMNS", "240")  # the tables are wide; rich wraps at 80 columns without a tty

    print_rows(
        f"reconfiguration, {cfg.param_count() / 1e6:.0f}M-param GPT + AdamW (times: slowest rank)",
        rows,
        ["change", "src", "dst", "hosts", "save_s", "load_s", "total_s", "kept_GB", "same_host_GB",
         "relayed_GB", "cross_GB", "cross_lb_GB", "x_dcp_disk", "x_dcp_disk_cold", "x_dcp_shm",
         "x_dcp_tenplex", "x_central", "x_central_load", "x_floor", "x_floor_verified", "x_dcp_shm_first",
         "x_dcp_disk_first"],
    )  # fmt: skip
    print_rows(
        "baselines (s)",
        rows,
        ["change", "hosts", "dcp_disk_save_s", "dcp_disk_load_s", "dcp_disk_load_cold_s", "dcp_shm_save_s",
         "dcp_shm_load_s", "dcp_tenplex_save_s", "dcp_tenplex_load_s", "central_save_s", "central_load_s",
         "central_local_load_s", "floor_s", "floor_verified_s"],
    )  # fmt: skip
    print_breakdown(rows)
    if args.network == "netns":
        print_rows(
            f"tenplex vs central on namespace hosts, NIC {args.nic_gbps or 'unshaped'} Gbit/s each way "
            "(Fig. 14-like; busiest = the most bytes one host's link carried in one direction)",
            rows,
            NETNS_COLUMNS,
        )
    off = [(r["change"], r["hosts"]) for r in rows if not r["paths"]["own_store_shm"]]
    if off:
        print("some ranks reached their own host's store over the network, not shared memory:", off)
    save_ratio = one_vs_two_host_saves(rows)
    if save_ratio:
        print("one host's save / two hosts' save of the same state:",
              ", ".join(f"{c} {x:.2f}" for c, x in save_ratio.items()))  # fmt: skip
    bad = [(r["change"], r["hosts"], r["bad"]) for r in rows if r["bad"]]
    if bad:
        print("WRONG VALUES after load:", bad)
    meta = {
        "model": model,
        "params": cfg.param_count(),
        "pairs": {c["name"]: [c["src"], c["dst"]] for c in cases},
        **floors.meta(before, after, procs),
        "dcp_disk_fs": disk_kind,
        "wall_s": wall,
        "repeat": args.repeat,
        "command": " ".join(["python", "benchmarks/bench_reconfig.py", *sys.argv[1:]]),
        "network": args.network,
        "save_1h_over_2h": save_ratio,
    }
    if args.network == "netns":
        meta.update(nic_gbps=args.nic_gbps, nic_latency_ms=args.nic_latency_ms,
                    links_GBps={str(r["cases"][0]["hosts"]): r["ring_GBps"] for r in runs})  # fmt: skip
    # namespace-host runs keep their own file, so neither kind of run replaces the other's figures
    name = "bench_reconfig" if args.network == "loopback" else "bench_reconfig_netns"
    # a case faster than its floor means the probes ran while the machine was slower than during the cases
    # (this VM's loopback TCP dropped to 1.4-1.8 GB/s for minutes at a time): such a run goes to a
    # temporary file, and results/ and the tables keep the last valid run
    below = [(r["change"], r["hosts"], round(r["x_floor"], 2)) for r in rows if r["x_floor"] < 1]
    out = args.out
    if below and out is None:
        out = tempfile.mkstemp(prefix=f"{name}-below-floor-", suffix=".json")[1]
    path = write_results(name, rows, meta, out)
    print(f"wrote {path}; {wall:.0f} s for the cases")
    if below:
        print(
            f"cases faster than their floor {below}: the floor probes (before: {floors.shown(before)}; "
            f"after: {floors.shown(after)}) met a slower machine than the cases did; rerun"
        )
    if bad or below:
        raise SystemExit(1)


if __name__ == "__main__":
    entry(main)
