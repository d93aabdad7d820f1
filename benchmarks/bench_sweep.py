"""The scale sweep: how a reconfiguration's save and load grow with the state, the ranks and the hosts.

Every point is the `combined` change of benchmarks/bench_reconfig.py generalised to R ranks, (dp, tp, pp)
= (1, R, 1) -> (2, R/4, 2) (every dimension changes, R ranks on both sides), on the same worker
(benchmarks/reconfig_worker.py: the reference GPT + AdamW as DTensors, each load checked bit for bit),
without central mode. Three series:

- **size**: 4 ranks on 2 loopback hosts, the state from 5 MB (the reference's 303 tensors, bench_reconfig's
  `--size fixed`) and ~0.3 GB doubling up to `--max-gb` (default: as large as fits, see below);
- **ranks**: R = 4, 8, 16 on 2 loopback hosts (ranks 0..R/2-1 on the first), at 5 MB and `--rank-gb`;
- **hosts** (`--network netns`, root): 2, 4, 8, 16 namespace hosts with shaped NICs (`--nic-gbps`), one
  rank per host (4 ranks on 2 hosts), at 5 MB and `--host-gb`; every namespace goes at the end (the
  existing netns code; a killed run's go at the next run).

Each point runs in a world of its own with stores of its own that pre-fault nothing, `--repeat` times:
`first_*` is the first repetition (fresh stores: the first touch of their memory), the plain figures the
best of the others (steady state: recycled memory). Per series, a least-squares line of seconds against
GB (per rank or host count for the other two: its 5 MB and its larger point): the intercept is the fixed
cost of a save or a load, the slope its seconds per GB. The knee: any point that failed (its reason) or
whose seconds per GB are more than 20% above the series' first point at that size. Memory: every 0.2 s
the anonymous memory of every process of the run (Pss_Anon: the ranks, the stores) plus the stores' and
DCP's files in shared memory; its peak per GB of state sets how far the size series grows (the next size
is run only while its predicted peak stays under 60% of the machine's memory and 80% of what is free).
The stores' own figure: bytes they hold (`memory_used`, and with their free pool and reserve) per byte
of state, right after the load. Baselines in the same run: the floor (bench_reconfig's, measured before
and after) and DCP through /dev/shm (`--no-dcp` leaves it out). `--budget-min` stops adding points past
it; the points left are recorded as skipped, with that reason.

    python benchmarks/bench_sweep.py                       # loopback: size and ranks series, ~10-15 minutes
    sudo -E python benchmarks/bench_sweep.py --network netns --nic-gbps 1 --budget-min 30  # results/
    python benchmarks/bench_sweep.py --quick   # the test's: 5 MB and 0.05 GB on 4 ranks, 5 MB on 8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import floors
from bench_reconfig import SIZES, phases_of, summarise
from common import entry, print_rows, write_results
from memory_peak import Peak
from tenplex.ptc.gpt import GPTConfig
from tenplex.runtime import netns
from tenplex.store import start_store
from worlds import need_netns, netns_world, run_world, token_dir

GIB = 1 << 30
TINY = 0.005  # the 5 MB point's nominal GB


def model_for(gb: float) -> dict:
    """The reference GPT whose parameters + AdamW moments (12 bytes a parameter) come nearest `gb`."""
    if gb <= TINY:  # heads as the larger ones: tp up to 16 divides them (the worker does not care)
        return {**SIZES["fixed"], "heads": 16}
    base = dict(layers=8, heads=16, vocab=256, seq=512)
    hidden = min(
        range(64, 8193, 64), key=lambda h: abs(GPTConfig(hidden=h, **base).param_count() * 12e-9 - gb)
    )
    return {**base, "hidden": hidden}


def change(ranks: int) -> tuple[list[int], list[int]]:
    """The combined change on `ranks` ranks: (1, R, 1) -> (2, R/4, 2)."""
    return [1, ranks, 1], [2, ranks // 4, 2]


def point_spec(p: dict, args, shm: Path) -> dict:
    src, dst = change(p["ranks"])
    case = {"name": f"combined-{p['ranks']}r", "src": src, "dst": dst, "hosts": p["hosts"], "central": False,
            "dcp": [] if args.no_dcp else ["shm"], "store_stats": True}  # fmt: skip
    return {"model": p["model"], "disk_dir": str(shm), "shm_dir": str(shm), "cases": [case],
            "repeat": args.repeat}  # fmt: skip


def run_point(p: dict, args, shm: Path) -> dict:
    """One point in a world of its own: what its ranks recorded and the memory's peak."""
    spec, world, hosts = point_spec(p, args, shm), p["ranks"], p["hosts"]
    shaped = None
    with Peak([shm]) as peak:
        if p["network"] == "netns":
            probe = int(max(16 << 20, (args.nic_gbps or 2.0) * 1e9 / 8))
            with token_dir() as (tmp, token), netns.Network(netns.prefix_for("benchmarks/bench_sweep"),
                                                            gbps=args.nic_gbps) as net:  # fmt: skip
                run = netns_world(net, tmp, token, spec, world, hosts, [0] * hosts, args.store_memory,
                                  args.timeout, probe)  # fmt: skip
            per_rank, shaped = run["per_rank"], run["shaped_bw"]
        else:
            with contextlib.ExitStack() as stack:
                urls = [
                    stack.enter_context(start_store(memory_limit=args.store_memory)).url for _ in range(hosts)
                ]
                spec.update(store_a=urls[0], store_b=urls[-1],
                            rank_stores=[urls[r * hosts // world] for r in range(world)])  # fmt: skip
                per_rank = run_world(spec, args.timeout, world)
    ranks = [r[0] for r in per_rank]
    state = sum(r["reps"][0]["src_bytes"] for r in ranks) / 1e9
    return {"status": "ok", "state_GB": state, "peak_GB": peak.peak / 1e9, "_ranks": ranks, "_shaped": shaped}


def finish(rows: list[dict], bw: dict[str, float]) -> list[dict]:
    """The measured points' rows with bench_reconfig's figures (floors: `bw`) and the sweep's."""
    out = []
    for r in rows:
        ranks, shaped = r.pop("_ranks", None), r.pop("_shaped", None)
        if ranks is not None:
            row = summarise(ranks, bw, shaped)
            r = {**row, **figures(row, ranks), **r}
        out.append(r)
    return out


def figures(row: dict, ranks: list[dict]) -> dict:
    """The steady state (the best repetition after the first), the first repetition, rates, and what the
    stores held after the load per byte of state."""
    gb, reps = row["state_GB"], row["reps"]
    later = slice(1, None) if len(reps["save_s"]) > 1 else slice(None)
    save, load = min(reps["save_s"][later]), min(reps["load_s"][later])
    total = save + load
    stats = next(r["reps"][0]["store_stats"] for r in ranks if r["reps"][0].get("store_stats"))
    out = {
        "status": "ok", "save_s": save, "load_s": load, "total_s": total, "x_floor": total / row["floor_s"],
        "first_save_s": reps["save_s"][0], "first_load_s": reps["load_s"][0],
        "first_total_s": reps["save_s"][0] + reps["load_s"][0],
        "save_GBps": gb / save, "load_GBps": gb / load, "GBps": gb / total, "s_per_GB": total / gb,
        "store_held_per_byte": sum(s["memory_used"] for s in stats.values()) / (gb * 1e9),
        "store_footprint_per_byte": sum(s["memory_used"] + s["memory_pooled"] + s["memory_reserved"]
                                        for s in stats.values()) / (gb * 1e9),
    }  # fmt: skip
    if row.get("dcp_shm_total_s"):
        out["x_dcp_shm"] = row["dcp_shm_total_s"] / total
    for kind in ("save", "load"):  # the phases of the repetition whose seconds are shown, not of the first
        best = min(range(len(reps[f"{kind}_s"]))[later], key=lambda i: reps[f"{kind}_s"][i])
        out[f"{kind}_phases"] = phases_of([r["reps"][best] for r in ranks], kind)
    return out


def plan_points(args) -> list[dict]:
    """Every point of every series, each once (a point two series share runs once and is in both)."""
    points: dict[tuple, dict] = {}

    def add(series: str, ranks: int, hosts: int, network: str, gb: float) -> None:
        new = {
            "ranks": ranks,
            "hosts": hosts,
            "network": network,
            "gb": gb,
            "model": model_for(gb),
            "series": [],
        }
        point = points.setdefault((ranks, hosts, network, gb), new)
        point["series"] += [series] if series not in point["series"] else []

    sizes = [float(x) for x in args.sizes.split(",")] if args.sizes else ladder(args.max_gb)
    for gb in sizes:
        add("size", 4, 2, "loopback", gb)
    for r in (int(x) for x in args.ranks.split(",")):
        for gb in (TINY, args.rank_gb):
            add("ranks", r, 2, "loopback", gb)
    if args.network == "netns":
        for h in (int(x) for x in args.hosts.split(",")):
            for gb in (TINY, args.host_gb):
                add("hosts", max(4, h), h, "netns", gb)
    return list(points.values())


def ladder(max_gb: float | None) -> list[float]:
    """5 MB, then ~0.3 GB doubling up to `max_gb` (None: until memory says stop, at most 16 steps)."""
    return [TINY, *(0.3 * 2**k for k in range(16) if max_gb is None or 0.3 * 2**k <= max_gb * 1.001)]


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def too_big(p: dict, rows: list[dict], limit: int) -> str | None:
    """Why `p` would not fit: its predicted peak (the peak of its 5 MB point, or of the smallest point with
    as many ranks, plus the most memory a GB of state has taken so far above the 5 MB point) past `limit`
    or 80% of the memory free now."""
    done = [r for r in rows if r.get("status") == "ok"]
    tiny = {(r["ranks"], r["hosts"]): r["peak_GB"] for r in done if r["gb"] <= TINY}
    base = tiny.get((p["ranks"], p["hosts"]), max(tiny.values(), default=0.0))
    per = max(((r["peak_GB"] - tiny.get((r["ranks"], r["hosts"]), 0.0)) / r["state_GB"] for r in done
               if r["gb"] > TINY), default=0.0)  # fmt: skip
    want = (base + per * p["gb"]) * 1e9
    free = 0.8 * meminfo("MemAvailable")
    if want > min(limit, free):
        cap = min(limit, free) / GIB
        return (f"predicted peak {want / GIB:.1f} GiB ({base:.2f} GB + {per:.2f} bytes a byte of state) > "
                f"{cap:.1f} GiB (60% of the machine's memory, 80% of what was free)")  # fmt: skip
    return None


def line(xs: list[float], ys: list[float]) -> dict:
    slope, intercept = np.polyfit(xs, ys, 1)
    return {"intercept_s": float(intercept), "slope_s_per_GB": float(slope)}


def groups(rows: list[dict]) -> dict[str, list[dict]]:
    """The fitted groups: the size series, and each rank or host count of the other two."""
    ok = [r for r in rows if r.get("status") == "ok"]
    out = {"size 4 ranks": [r for r in ok if "size" in r["series"]]}
    for series, what in (("ranks", "ranks"), ("hosts", "hosts")):
        for n in sorted({r[what] for r in ok if series in r["series"]}):
            out[f"{series} {n} {what}"] = [r for r in ok if series in r["series"] and r[what] == n]
    return out


def fits(rows: list[dict]) -> dict[str, dict]:
    """Seconds against GB, least squares, per group with two sizes or more: save, load, steady and first."""
    out = {}
    for name, rs in groups(rows).items():
        if len({r["gb"] for r in rs}) < 2:
            continue
        xs = [r["state_GB"] for r in rs]
        out[name] = {
            k: line(xs, [r[f"{k}_s"] for r in rs]) for k in ("save", "load", "first_save", "first_load")
        }
        out[name]["points"] = len(rs)
    return out


def knees(rows: list[dict]) -> list[dict]:
    """Points that failed, and points whose seconds per GB are > 20% above their series' first point of the
    same size (the smallest size, the fewest ranks or hosts); the 5 MB points' growth is the intercepts'."""
    out = [{"point": r["name"], "why": f"failed: {r['why']}"} for r in rows if r.get("status") == "failed"]
    for series in ("size", "ranks", "hosts"):
        by_size: dict[float, list[dict]] = {}
        for r in rows:
            if r.get("status") == "ok" and series in r["series"] and r["gb"] > TINY:  # 5 MB: fixed costs
                by_size.setdefault(r["gb"] if series != "size" else 0.0, []).append(r)
        for rs in by_size.values():
            first = rs[0]
            for r in rs[1:]:
                ratio = r["s_per_GB"] / first["s_per_GB"]
                if ratio > 1.2:
                    why = f"{r['s_per_GB']:.3f} s/GB, {ratio:.2f}x {first['name']}'s {first['s_per_GB']:.3f}"
                    out.append({"point": r["name"], "series": series, "ratio": ratio, "why": why})
    return out


def name_of(p: dict) -> str:
    where = f"{p['hosts']} netns hosts" if p["network"] == "netns" else f"{p['hosts']} loopback hosts"
    return f"{p['ranks']} ranks, {where}, {p['gb']:g} GB"


def sweep(args, points: list[dict], shm: Path) -> list[dict]:
    """Every point in order, each recorded: measured, failed (with its reason), or skipped (with why)."""
    rows: list[dict] = []
    limit = int(0.6 * meminfo("MemTotal"))
    started = time.monotonic()
    for p in points:
        src, dst = ("x".join(map(str, layout)) for layout in change(p["ranks"]))
        keep = ("series", "ranks", "hosts", "network", "gb", "model")
        head = {"name": name_of(p), **{k: p[k] for k in keep}, "world": p["ranks"], "src": src, "dst": dst}
        if time.monotonic() - started > args.budget_min * 60:
            rows.append(
                {**head, "status": "skipped", "why": f"past the budget of {args.budget_min:g} minutes"}
            )
            continue
        if p["series"] == ["size"] and any(
            r["series"] == ["size"] and r["status"] == "skipped" for r in rows
        ):
            continue  # the ladder stopped at the first size that did not fit: that row says so
        why = too_big(p, rows, limit)
        if why:
            larger = "; the larger sizes not tried" if p["series"] == ["size"] else ""
            rows.append({**head, "status": "skipped", "why": why + larger})
            continue
        print(f"{head['name']}: {GPTConfig(**p['model']).param_count() * 12 / 1e9:.3f} GB", flush=True)
        try:
            rows.append({**run_point(p, args, shm), **head, "load": os.getloadavg()[0]})  # others' jobs
        except (Exception, SystemExit) as e:  # a failing point is a finding: recorded, and the sweep goes on
            rows.append({**head, "status": "failed", "why": f"{type(e).__name__}: {e}"[:500]})
    return rows


COLUMNS = ["name", "status", "save_s", "load_s", "first_save_s", "first_load_s", "GBps", "s_per_GB",
           "dcp_shm_total_s", "x_dcp_shm", "x_floor", "peak_GB", "store_held_per_byte", "why"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-gb", type=float, default=None, help="largest state (default: what memory allows)")
    ap.add_argument(
        "--sizes", default=None, help="the size series' GB, comma-separated (default: the ladder)"
    )
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--rank-gb", type=float, default=0.6, help="the ranks series' larger size")
    ap.add_argument("--hosts", default="2,4,8,16", help="netns: the hosts series")
    ap.add_argument("--host-gb", type=float, default=0.3, help="the hosts series' larger size")
    ap.add_argument("--network", choices=("loopback", "netns"), default="loopback",
                    help="netns (root): the hosts series too")  # fmt: skip
    ap.add_argument("--nic-gbps", type=float, default=1.0, help="netns: each host's NIC, each way")
    ap.add_argument("--repeat", type=int, default=2, help="repetitions a point (the first: fresh stores)")
    ap.add_argument("--budget-min", type=float, default=15, help="no new point past this many minutes")
    ap.add_argument("--no-dcp", action="store_true", help="leave out DCP through /dev/shm")
    ap.add_argument("--store-memory", default="16GiB")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a point may take")
    ap.add_argument("--quick", action="store_true", help="the test's: 4 ranks, 8 at 5 MB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.ranks, args.rank_gb = f"{TINY},0.05", "4,8", TINY
    if args.network == "netns":
        need_netns("bench_sweep")
    procs = min(len(os.sched_getaffinity(0)), 4)
    rounds = 3 if args.quick else 9  # --quick: the floor from fewer rounds
    before = floors.measure(procs, rounds)
    print(f"floor on {procs} cores: {floors.shown(before)}", flush=True)
    shm = Path(tempfile.mkdtemp(prefix="tenplex-sweep-dcp-", dir="/dev/shm"))
    started = time.perf_counter()
    try:
        rows = sweep(args, plan_points(args), shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    wall = time.perf_counter() - started
    after = floors.measure(procs, rounds)
    report(args, finish(rows, floors.best(before, after)), before, after, procs, wall)


def report(args, rows: list[dict], before: dict, after: dict, procs: int, wall: float) -> None:
    os.environ.setdefault("COLUMNS", "240")
    print_rows("the scale sweep (steady state: best repetition after the first)", rows, COLUMNS)
    fitted, kneed = fits(rows), knees(rows)
    for name, f in fitted.items():
        print(f"{name}: " + "; ".join(f"{k} {v['intercept_s'] * 1e3:.0f} ms + {v['slope_s_per_GB']:.3f} s/GB"
                                     for k, v in f.items() if k != "points"))  # fmt: skip
    for k in kneed:
        print(f"knee: {k['point']}: {k['why']}")
    skipped = [r for r in rows if r.get("status") == "skipped"]
    meta = {
        **floors.meta(before, after, procs),
        "fits": fitted, "knees": kneed, "budget_min": args.budget_min,
        "stopped_by_budget": any("budget" in r["why"] for r in skipped),
        "memory_limit_GB": 0.6 * meminfo("MemTotal") / 1e9, "wall_s": wall, "repeat": args.repeat,
        "peak_per_GB": max((r["peak_GB"] / r["state_GB"] for r in rows if r.get("status") == "ok"
                            and r["gb"] > TINY), default=None),
        "command": " ".join(["python", "benchmarks/bench_sweep.py", *sys.argv[1:]]),
        "network": args.network, "nic_gbps": args.nic_gbps if args.network == "netns" else None,
    }  # fmt: skip
    path = write_results("bench_sweep", rows, meta, args.out)
    print(f"wrote {path}; {wall:.0f} s for the points")
    bad = [(r["name"], r["bad"]) for r in rows if r.get("bad")]
    if bad:
        print("WRONG VALUES after load:", bad)
        raise SystemExit(1)


if __name__ == "__main__":
    entry(main)
