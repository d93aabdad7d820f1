"""Small states: tenplex against DCP on the same gloo ranks, and the fixed cost of a save and a load.

The Hugging Face Llama of tests/test_hf.py and torchtitan's Llama 3 of tests/test_titan.py (a few MB, ~100
tensors with AdamW's moments; FSDP2, DTensors) on 2 and 4 ranks, and a tiny state (8 tensors of 64 bytes a
rank) on 4, 8 and 16 ranks, where what is measured is the fixed cost per save and load (16 gloo ranks on 2
cores is fine: the compute is idle). Per repetition, on the same ranks, alternating which goes first:
tenplex `save`, `load` into the same layout and into another one (`reshard`: HSDP 2 x world/2 for HF, tp 2
for torchtitan), and DCP `save` / `load` of the same through /dev/shm. Every load is checked bit for bit.

Each figure is the slowest rank's seconds, best and median over `--repeat` repetitions (after `--warmup`
untimed ones); ratios are tenplex / DCP (<= 1: tenplex is no slower). The phases are those of tenplex's
best repetition, the slowest rank per phase (SaveHandle.phases, LoadInfo.phases).

    python benchmarks/bench_small.py --out results/bench_small.json
    python benchmarks/bench_small.py --quick      # 2 ranks only, 3 repetitions
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import entry, print_rows, write_results
from tenplex.store import start_store
from worlds import run_world

MODELS = ("hf", "titan")
SYSTEMS = ("tenplex", "dcp")
PARTS = ("save", "load_same", "load_reshard")


def worlds(model_worlds: list[int], fixed_worlds: list[int]) -> dict[int, list[str]]:
    """Per world size, the states measured in it."""
    out: dict[int, list[str]] = {}
    for w in model_worlds:
        out.setdefault(w, []).extend(MODELS)
    for w in fixed_worlds:
        out.setdefault(w, []).append("tiny")
    return dict(sorted(out.items()))


def row(world: int, name: str, per_rank: list[dict], warmup: int) -> dict:
    """One state on one world: best and median per system and part, ratios, phases, what failed a check."""
    first = per_rank[0]["states"][name]
    reps = [[r["states"][name]["reps"][k] for r in per_rank] for k in range(warmup, len(first["reps"]))]
    out: dict = {"state": name, "ranks": world, "tensors": first["tensors"], "MB": first["bytes"] / 1e6}
    for part in PARTS:
        for system in SYSTEMS:
            key = f"{system}_{part}"
            slowest = [max(r[key] for r in rep) for rep in reps if key in rep[0]]
            if slowest:
                out[f"{system}_{part}_s"] = min(slowest)
                out[f"{system}_{part}_median_s"] = statistics.median(slowest)
        if f"tenplex_{part}_s" in out:
            out[f"x_{part}"] = out[f"tenplex_{part}_s"] / out[f"dcp_{part}_s"]
            out[f"x_{part}_median"] = out[f"tenplex_{part}_median_s"] / out[f"dcp_{part}_median_s"]
    out["bad"] = sorted({b for rep in reps for r in rep for b in r.get("bad", [])})
    best = min(range(len(reps)), key=lambda k: max(r["tenplex_save"] for r in reps[k]))
    out["save_phases"] = _slowest_phases([r["save_phases"] for r in reps[best]])
    out["load_phases"] = _slowest_phases([r["load_phases_same"] for r in reps[best]])
    # round trips and collectives per rank of the last repetition: the most any rank made, and all ranks'
    out["counts"] = {what: {k: [r["counts"][what].get(k, 0) for r in reps[-1]] for k in
                            sorted(set().union(*(r["counts"][what] for r in reps[-1])))}
                     for what in reps[-1][0]["counts"]}  # fmt: skip
    return out


def _slowest_phases(phases: list[dict[str, float]]) -> dict[str, float]:
    return {k: max(p.get(k, 0.0) for p in phases) for k in sorted(set().union(*phases))}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="rank counts for the HF and torchtitan states")
    p.add_argument("--fixed-worlds", default="4,8,16", help="rank counts for the tiny state")
    p.add_argument("--repeat", type=int, default=7, help="timed repetitions; best and median reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--quick", action="store_true", help="2 ranks for every state, 3 repetitions")
    p.add_argument("--store-memory", default="2GiB")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="a directory: rank 0's cProfile of the last repetition")
    args = p.parse_args()
    if args.quick:
        args.worlds, args.fixed_worlds, args.repeat = "2", "2", 3
    args.model_worlds = [int(w) for w in args.worlds.split(",") if w]
    args.fixed_list = [int(w) for w in args.fixed_worlds.split(",") if w]
    return args


COLUMNS = ["state", "ranks", "tensors", "MB"] + [
    f"{k}_{p}" + ("" if k == "x" else "_s") for p in PARTS for k in ("tenplex", "dcp", "x")
]


def main() -> None:
    args = parse()
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tenplex-small-", dir="/dev/shm") as shm:
        for world, names in worlds(args.model_worlds, args.fixed_list).items():
            with start_store(memory_limit=args.store_memory) as store:
                spec = {"store": store.url, "shm_dir": shm, "states": names, "repeat": args.repeat,
                        "warmup": args.warmup, "profile": args.profile}  # fmt: skip
                per_rank = run_world(spec, args.timeout, world=world, worker="small_worker")
            rows.extend(row(world, name, per_rank, args.warmup) for name in names)
    print_rows("small states: tenplex / DCP (best of repetitions)", rows, COLUMNS)
    command = "python benchmarks/bench_small.py" + (" --quick" if args.quick else "")
    meta = {"repeat": args.repeat, "warmup": args.warmup, "wall_s": time.perf_counter() - started,
            "command": command + (f" --out {args.out}" if args.out else "")}  # fmt: skip
    path = write_results("bench_small", rows, meta, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    entry(main)
