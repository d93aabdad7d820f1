"""Planning time against devices (64 ... 4096) and tensors, for GPT-3 presets.

Each row scales a job out by doubling dp. The baseline, measured in the same run, is an all-pairs overlap
search (what a planner without an index does, e.g. PyTorch DCP's resharding): for every new shard it scans
every old shard of the tensor. It runs only up to --baseline-max devices, since it grows quadratically.
Each row also matches the new ranks to the devices holding their state (`tenplex.planner.assign`) and
reports the cross-host bytes against taking the devices in numbering order, in the same run.

Times are CPU seconds of this process (`time.process_time`): planning is single-threaded, and on a shared
machine wall time mostly measures the other jobs (gpt3-175b 4096 -> 8192 planned in 0.29 s of wall time
on an idle machine, 1.63 s at load average 31).

    python benchmarks/bench_planner.py [--max-devices 4096] [--out results/bench_planner.json]
"""

from __future__ import annotations

import argparse
import time

from common import print_rows, write_results
from tenplex.planner import assign_plan, central_plan, plan
from tenplex.ptc import PTC, gpt_ptc, preset

# (preset, tp, pp) per model: tp within a host, pp as in Megatron-LM's usual recipes
MODELS = [("gpt3-125m", 4, 4), ("gpt3-2.7b", 8, 4), ("gpt3-175b", 8, 16)]


def all_pairs_seconds(old: PTC, new: PTC) -> float:
    """The naive planner: every new shard against every old shard of the same tensor."""
    t = time.process_time()
    by_tensor: dict[str, list] = {}
    for s in old.all_shards():
        by_tensor.setdefault(s.tensor, []).append(s)
    pieces = 0
    for rank in range(new.mesh.size):
        for s in new.shards(rank):
            for o in by_tensor[s.tensor]:
                if o.box.intersect(s.box) is not None:
                    pieces += 1
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-devices", type=int, default=4096)
    ap.add_argument("--baseline-max", type=int, default=256)
    ap.add_argument("--out")
    args = ap.parse_args()
    tiny = preset("tiny")
    assign_plan(gpt_ptc(tiny, 1, 2, 2), gpt_ptc(tiny, 2, 2, 2))  # untimed: imports scipy.optimize once
    rows = []
    for name, tp, pp in MODELS:
        cfg = preset(name)
        devices = 64
        while devices <= args.max_devices:
            dp = devices // (tp * pp)
            if dp >= 1:
                old = gpt_ptc(cfg, dp, tp, pp)
                new = gpt_ptc(cfg, 2 * dp, tp, pp)
                t = time.process_time()
                p = plan(old, new)
                seconds = time.process_time() - t
                t = time.process_time()
                central_plan(old, new)
                central_seconds = time.process_time() - t
                shards = sum(len(pc.holders) for n in new.tensors for pc in new.pieces(n))
                base = all_pairs_seconds(old, new) if 2 * devices <= args.baseline_max else None
                t = time.process_time()
                matched = assign_plan(old, new)[0].stats.cross_host  # plans numbering order too, to compare
                assign_seconds = time.process_time() - t
                rows.append(
                    {
                        "model": name,
                        "from": f"dp={dp},tp={tp},pp={pp}",
                        "devices": f"{devices}->{2 * devices}",
                        "tensors": len(new.tensors),
                        "new_shards": shards,
                        "plan_s": seconds,
                        "central_plan_s": central_seconds,
                        "all_pairs_s": base,
                        "speedup_vs_all_pairs": base / seconds if base else None,
                        "cross_host_GB": p.stats.cross_host / 1e9,
                        "lower_bound_GB": p.stats.cross_host_lower_bound / 1e9,
                        "assign_s": assign_seconds,
                        "matched_cross_host_GB": matched / 1e9,
                        "matched_vs_numbering": matched / p.stats.cross_host if p.stats.cross_host else None,
                    }
                )
                print(rows[-1], flush=True)
            devices *= 2
    cols = ["model", "devices", "tensors", "new_shards", "plan_s", "all_pairs_s", "speedup_vs_all_pairs"]
    print_rows("planning time (scale-out by doubling dp)", rows, cols)
    cols = ["model", "devices", "assign_s", "cross_host_GB", "matched_cross_host_GB", "matched_vs_numbering"]
    print_rows("matching ranks to devices (assign + plan, against devices in numbering order)", rows, cols)
    print("wrote", write_results("bench_planner", rows, path=args.out))


if __name__ == "__main__":
    main()
