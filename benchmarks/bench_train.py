"""Tokens/s and step time of one GPT under every valid (dp, tp, pp) layout for 1..N local ranks.

Calibration data for the parallelization chooser. One spawned process group per world size runs all its
layouts (spawn and imports cost more than a few steps). The baseline is the 1-rank run of the same
invocation; every row reports its throughput relative to it.

    python benchmarks/bench_train.py                      # small model, 1-4 ranks, ~1-2 min on 2 cores
    python benchmarks/bench_train.py --model base --steps 8 --max-world 4 --fsdp --out train.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from tenplex.data import build_corpus
from tenplex.ptc import preset
from tenplex.ptc.layout import Layout, layouts
from tenplex.train.cases import Case, CaseResult, run_cases
from tenplex.train.config import TrainConfig
from tenplex.train.launch import spawn


def bench(args: argparse.Namespace) -> list[dict]:
    corpus = build_corpus(args.source or None)
    base = TrainConfig(
        model=args.model,
        steps=args.warmup + args.steps,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        seed=0,
        warmup=2,
    )
    rows = []
    for world in range(1, args.max_world + 1):
        todo: list[Layout] = layouts(preset(args.model), world)
        if args.fsdp:
            todo += [replace(lay, fsdp=True) for lay in todo if lay.dp > 1]
        cases = [Case(replace(base, dp=lay.dp, tp=lay.tp, pp=lay.pp, fsdp=lay.fsdp)) for lay in todo]
        t0 = time.perf_counter()
        per_rank: list[list[CaseResult]] = spawn(run_cases, world, cases, str(corpus.path))
        print(f"world {world}: {len(cases)} layouts in {time.perf_counter() - t0:.1f}s", flush=True)
        for i, lay in enumerate(todo):
            r = per_rank[0][i]
            times = r.step_times[args.warmup :]
            step = statistics.median(times)
            rows.append(
                {
                    "world": world,
                    "dp": lay.dp,
                    "tp": lay.tp,
                    "pp": lay.pp,
                    "fsdp": lay.fsdp,
                    "layout": str(lay),
                    "step_time_s": step,
                    "step_time_min_s": min(times),
                    "tokens_per_s": r.tokens_per_step / step,
                    "final_loss": r.losses[-1],
                }
            )
    base_tps = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_1_rank"] = row["tokens_per_s"] / base_tps
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--max-world", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per layout")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--fsdp", action="store_true", help="also every layout with dp > 1 under FSDP2")
    p.add_argument("--source", action="append", default=[], help="corpus files/dirs (default: the stdlib)")
    p.add_argument("--out", default="results/bench_train.json")
    args = p.parse_args()
    rows = bench(args)
    cfg = preset(args.model)
    meta = {
        "benchmark": "train",
        "model": args.model,
        "params": cfg.param_count(),
        "seq": cfg.seq,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "timed_steps": args.steps,
        "torch": torch.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    size = f"{cfg.param_count() / 1e6:.1f}M params"
    print(f"\n{args.model} ({size}), global batch {args.global_batch} x seq {cfg.seq}")
    print(f"{'layout':22s} {'step s':>8s} {'tokens/s':>10s} {'vs 1 rank':>9s} {'loss':>7s}")
    for r in rows:
        print(
            f"{r['layout']:22s} {r['step_time_s']:8.3f} {r['tokens_per_s']:10.0f} {r['vs_1_rank']:9.2f} "
            f"{r['final_loss']:7.3f}"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
