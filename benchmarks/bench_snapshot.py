"""What periodic in-memory snapshots cost training: tokens/s with `--snapshot-every K` against none.

The reference workload (`tenplex.train.Trainer`) runs in one spawned process group against one store;
snapshots go through `ElasticJob.step_done`, the path `tenplex run` uses (asynchronous `tenplex.save`,
`keep` versions). The variants (no snapshots, K = 1, 5, 10) alternate in blocks of `--block` steps, in a
rotated order each round, so that the machine's load drifts over all of them alike. A block's clock stops
after its last step: its last snapshot, which in a run of one K would commit while the next steps train,
is then waited for outside the block (`tail wait ms`), and its work lands in the CPU figure below.
Target: <= 3% fewer tokens/s at K = 5.

Two measures: wall time (tokens/s, what a user sees on a quiet machine) and CPU time of the ranks (every
thread, so the background writes count) plus the store daemon's, per token. On a shared machine whose load
swings by 10x between blocks only the second is stable, so `ok` is judged on it (with `--device cuda`, on
wall time: the GPU's work is no rank's CPU time); `stall` is the time the
training thread spent inside `step_done` per snapshot.

    python benchmarks/bench_snapshot.py [--model small] [--dp 2] [--rounds 4] [--block 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import print_rows, write_results

KS = (0, 1, 5, 10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ranks(cfg, corpus_path: str, block: int, rounds: int, warmup: int, out: str, store_pid: int) -> dict:
    """One rank: warm up, then `rounds` rounds of one block per variant; seconds and stalls per K."""
    import torch
    import torch.distributed as dist

    from tenplex.data import Corpus
    from tenplex.runtime.job import ElasticJob
    from tenplex.train.trainer import Trainer
    from tenplex.transformer.save import wait_for_pending

    trainer = Trainer(cfg, Corpus(Path(corpus_path)))
    for _ in range(warmup):
        trainer.train_step()
    jobs = {k: ElasticJob(f"snap-k{k}", until=1 << 30, snapshot_every=k, keep=2, out=f"{out}/k{k}")
            for k in KS}  # fmt: skip
    seconds: dict[int, list[float]] = {k: [] for k in KS}
    cpu: dict[int, list[float]] = {k: [] for k in KS}
    tail: dict[int, list[float]] = {k: [] for k in KS}
    phases: dict[int, list[dict[str, float]]] = {k: [] for k in KS}
    for r in range(rounds):
        for k in KS[r % len(KS) :] + KS[: r % len(KS)]:
            dist.barrier()
            t, c, cs = time.perf_counter(), time.process_time(), cpu_seconds(store_pid)
            for _ in range(block):
                m = trainer.train_step()
                jobs[k].step_done(m.step, trainer.state_dict, loss=m.loss)
            dist.barrier()
            seconds[k].append(time.perf_counter() - t)
            w = time.perf_counter()
            if not wait_for_pending(600):
                raise RuntimeError("a snapshot did not commit in 600 s")
            tail[k].append(time.perf_counter() - w)
            used = torch.tensor([time.process_time() - c], dtype=torch.float64, device=trainer.device)
            dist.all_reduce(used)  # every rank's CPU time, the background writes' included
            cpu[k].append(float(used) + cpu_seconds(store_pid) - cs)
            if jobs[k]._pending is not None:  # the block's last snapshot: where its time went
                phases[k].append(jobs[k]._pending.phases)
    out = {"seconds": seconds, "cpu": cpu, "tail": tail, "phases": phases}
    return {**out, "tokens_per_step": trainer.tokens_per_batch}


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else device


def snapshots(out: Path, k: int) -> list[dict]:
    path = out / f"k{k}" / "worker.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "snapshot"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=10, help="steps per block (a multiple of every K)")
    ap.add_argument("--rounds", type=int, default=4, help="4: every K takes every place in the order once")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: a rank per GPU, state staged through pinned buffers; ok judged on wall time",
    )
    ap.add_argument("--store-args", default="", help="extra store flags, e.g. '--huge-pages off'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if any(k and args.block % k for k in KS):
        ap.error(f"--block must be a multiple of {max(KS)}")

    from tenplex.data import build_corpus
    from tenplex.store import start_store
    from tenplex.train.config import TrainConfig
    from tenplex.train.launch import spawn

    cfg = TrainConfig(model=args.model, dp=args.dp, tp=args.tp, pp=args.pp, global_batch=args.global_batch,
                      steps=1 << 30, warmup=2, seed=0, device=args.device)  # fmt: skip
    corpus = build_corpus(None)
    sp = start_store(memory_limit="4GiB", extra=args.store_args.split())
    os.environ["TENPLEX_STORE"] = sp.url  # the spawned ranks inherit it
    try:
        with tempfile.TemporaryDirectory(prefix="tenplex-bench-snapshot-") as tmp:
            t0 = time.perf_counter()
            work = (cfg, str(corpus.path), args.block, args.rounds, args.warmup, tmp, sp.proc.pid)
            res = spawn(ranks, cfg.layout.world, *work, device=args.device)
            wall = time.perf_counter() - t0
            records = {k: snapshots(Path(tmp), k) for k in KS if k}
        health = sp.client().health()
    finally:
        sp.stop()
    seconds = {int(k): v for k, v in res[0]["seconds"].items()}
    cpu = {int(k): sum(v) for k, v in res[0]["cpu"].items()}
    tokens = res[0]["tokens_per_step"] * args.block
    base = [tokens / s for s in seconds[0]]
    rows = []
    for k in KS:
        tps = [tokens / s for s in seconds[k]]
        total = tokens * len(tps) / sum(seconds[k])
        row = {"snapshot_every": k or "never", "tokens/s": total,
               "overhead %": 100 * (1 - total / (tokens * len(base) / sum(seconds[0]))),
               # per round against that round's block without snapshots: less sensitive to drift
               "median overhead %": 100 * statistics.median(1 - a / b for a, b in zip(tps, base)),
               "cpu s per 1k tokens": 1e3 * cpu[k] / (tokens * len(tps)),
               "cpu overhead %": 100 * (cpu[k] / cpu[0] - 1)}  # fmt: skip
        if k:
            for name in sorted({p for ph in res[0]["phases"][k] for p in ph}):
                row[f"{name} ms"] = 1e3 * statistics.median(ph.get(name, 0.0) for ph in res[0]["phases"][k])
            stalls = [r["stall"] for r in records[k]]
            row.update(
                snapshots=len(stalls),
                **{
                    "stall ms (median)": 1e3 * statistics.median(stalls),
                    "tail wait ms": 1e3 * statistics.median(res[0]["tail"][k]),
                },
            )
            judged = row["cpu overhead %" if args.device == "cpu" else "overhead %"]
            row["target"], row["ok"] = ("<= 3%", judged <= 3.0) if k == 5 else ("", None)
        rows.append(row)
    meta = {"model": args.model, "layout": str(cfg.layout), "device": device_name(args.device),
            "block": args.block, "rounds": args.rounds,
            "store": {"huge_pages": health.get("huge_pages")}, "wall_s": wall}  # fmt: skip
    path = write_results("bench_snapshot", rows, meta, args.out)
    print_rows(f"snapshot overhead, {args.model} {cfg.layout}, {args.rounds} x {args.block} steps per K",
               rows, ["snapshot_every", "tokens/s", "overhead %", "median overhead %", "cpu s per 1k tokens",
                      "cpu overhead %", "snapshots", "stall ms (median)", "target", "ok"])  # fmt: skip
    phase_cols = sorted({c for r in rows for c in r if c.endswith(" ms") and not c.startswith("stall")})
    print_rows(
        "the last snapshot of each block, median ms by phase (SaveHandle.phases)",
        [r for r in rows if r["snapshot_every"] != "never"],
        ["snapshot_every", *phase_cols],
    )
    print(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
