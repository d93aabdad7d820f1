"""Resharding a Megatron-core GPTModel: tenplex against Megatron's own `dist_checkpointing`, one state.

Two gloo ranks hold a GPTModel at tp 2. Each change (tp 2 → dp 2 × tp 1, tp 2 → pp 2) is timed both ways in
one run, round after round: tenplex (`tenplex.save` of `model_state(model)` to the store, `tenplex.load`
into the model of the new layout) and Megatron (`dist_checkpointing.save`, torch_dist, to /dev/shm, and
`dist_checkpointing.load` + `load_state_dict` into the new layout's model, built beforehand as tenplex's
is). Every loaded tensor is checked bitwise against Megatron's own checkpoint read back whole. The first
round is reported apart (Megatron's first save in a process starts a `spawn` multiprocessing manager);
the steady figures are the median of the other rounds. `x_megatron` = Megatron's save + load over
tenplex's. The ranks run on the CPU with the tests' stand-ins for Megatron's CUDA-only spots
(`tests/megatron_cpu.py`, imported from tests/: what they avoid is named there), and the checks and
timers of the tests' worker (`tests/megatron_cases.py`).

    python benchmarks/bench_megatron.py [--size tiny|small|medium] [--rounds 4] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import print_rows, write_results

ROOT = Path(__file__).resolve().parents[1]
# hidden, layers, heads, vocab, seq: about 0.15 MB, 21 MB and 108 MB of fp32 weights
SIZES = {"tiny": (32, 2, 4, 128, 16), "small": (256, 4, 8, 4096, 64), "medium": (512, 6, 8, 8192, 128)}
JOB = "bench-megatron"
CHANGES = {"tp2 → dp2 × tp1": (1, 1), "tp2 → pp2": (1, 2)}


def rank_main(size: str, rounds: int, out: str) -> None:
    """One rank: every round, every change both ways; this rank's seconds and its mismatches."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    import megatron_cpu as mc
    import tenplex
    from megatron_cases import differ, tensors, timed
    from tenplex.integrations.megatron import model_state
    from tenplex.integrations.megatron_checkpoint import read_torch_dist

    dist.init_process_group("gloo")
    mc.on_cpu()
    hidden, layers, heads, vocab, seq = SIZES[size]
    dims = {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab, "seq": seq}
    shm = Path(tempfile.mkdtemp(prefix="bench-megatron-", dir="/dev/shm")) if dist.get_rank() == 0 else None
    folder = _shared(str(shm))
    times: dict[str, list[dict[str, float]]] = {c: [] for c in CHANGES}
    bad: list[str] = []
    moved: dict[str, float] = {}
    for n in range(rounds):
        for i, (change, (tp, pp)) in enumerate(CHANGES.items()):
            step, path = n * len(CHANGES) + i + 1, f"{folder}/r{n}-{i}"
            mc.init_parallel(tp=2)
            source = mc.tiny_gpt(2, 1, 0, **dims)
            t = {"tenplex_save_s": timed(tenplex.save, {"model": model_state(source)}, JOB, step, keep=1)}
            if dist.get_rank() == 0:
                os.makedirs(path)
            t["megatron_save_s"] = timed(dist_checkpointing.save, source.sharded_state_dict(), path)
            want = read_torch_dist(path)
            mc.init_parallel(tp=tp, pp=pp)
            ours, theirs = mc.tiny_gpt(tp, pp, 1, **dims), mc.tiny_gpt(tp, pp, 2, **dims)
            t["tenplex_load_s"] = timed(tenplex.load, {"model": model_state(ours)}, JOB, step)
            t["megatron_load_s"] = timed(
                lambda m=theirs, at=path: m.load_state_dict(
                    dist_checkpointing.load(m.sharded_state_dict(), at)
                )
            )
            bad += differ(tensors(ours), want, f"round {n} {change} tenplex")
            bad += differ(tensors(theirs), want, f"round {n} {change} megatron")
            times[change].append(t)
            dist.barrier()
            if dist.get_rank() == 0:
                if n == rounds - 1 and i == 0:  # the last tp 2 checkpoint, in and out without the model
                    moved = import_export(path, want)
                    bad += moved.pop("bad")
                shutil.rmtree(path)
    nbytes = sum(t.numel() * t.element_size() for t in want.values() if t is not None)
    Path(out, f"rank{dist.get_rank()}.json").write_text(
        json.dumps({"times": times, "bad": bad, "bytes": nbytes, **moved})
    )
    if shm is not None:
        shutil.rmtree(shm, ignore_errors=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def import_export(path: str, want: dict) -> dict:
    """`tenplex import megatron` and `tenplex export megatron` on `path`, timed as commands (their own
    processes: the interpreter's and torch's start included); the exported folder read back against `want`."""
    import torch

    from megatron_cases import bits, cli
    from tenplex.integrations.megatron_checkpoint import read_torch_dist

    out: dict = {"bad": []}
    job = JOB + "-import"
    commands = {"import_s": ["import", "megatron", path, "--job", job, "--step", "1"],
                "export_s": ["export", "megatron", f"{path}-exported", "--job", job]}  # fmt: skip
    for name, args in commands.items():
        start = time.perf_counter()
        r = cli(*args)
        out[name] = time.perf_counter() - start
        if r.returncode != 0:
            out["bad"].append(f"tenplex {args[0]} megatron: {r.stderr.strip()[-300:]}")
            return out
    back = read_torch_dist(f"{path}-exported")
    out["bad"] = [
        f"export: {k}" for k, t in want.items() if t is not None and not torch.equal(bits(back[k]), bits(t))
    ]
    shutil.rmtree(f"{path}-exported")
    return out


def _shared(path: str) -> str:
    """Rank 0's value, on every rank."""
    import torch.distributed as dist

    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def summarize(ranks: list[dict], size: str) -> list[dict]:
    """One row per change: the first round, and the median of the others (the slowest rank's time each)."""
    rows = []
    for change in CHANGES:
        per_round = [{k: max(r["times"][change][i][k] for r in ranks) for k in ranks[0]["times"][change][i]}
                     for i in range(len(ranks[0]["times"][change]))]  # fmt: skip
        steady = per_round[1:] or per_round
        row = {"change": change, "size": size, "state_MB": ranks[0]["bytes"] / 1e6, "rounds": len(per_round)}
        for k in per_round[0]:
            row[k] = statistics.median(r[k] for r in steady)
            row[f"first_{k}"] = per_round[0][k]
        for pre in ("", "first_"):
            row[f"{pre}tenplex_total_s"] = row[f"{pre}tenplex_save_s"] + row[f"{pre}tenplex_load_s"]
            row[f"{pre}megatron_total_s"] = row[f"{pre}megatron_save_s"] + row[f"{pre}megatron_load_s"]
            row[f"{pre}x_megatron"] = row[f"{pre}megatron_total_s"] / row[f"{pre}tenplex_total_s"]
        row["bad"] = sorted({b for r in ranks for b in r["bad"]})
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument(
        "--rounds", type=int, default=4, help="rounds of both changes; the first is reported apart"
    )
    p.add_argument("--out", default=None, help="results file (default results/bench_megatron.json)")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank of the run
    p.add_argument("--rank-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        rank_main(args.size, args.rounds, args.rank_out)
        return 0
    from tenplex.store import start_store
    from tenplex.util.ranks import run_local

    argv = [sys.executable, __file__, "--rank", "--size", args.size, "--rounds", str(args.rounds)]
    with (
        tempfile.TemporaryDirectory(prefix="bench-megatron-") as out,
        start_store(memory_limit="4GiB") as store,
    ):
        paths = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "TENPLEX_STORE": store.url, "OMP_NUM_THREADS": "1", "PYTHONPATH": paths}
        run_local([*argv, "--rank-out", out], 2, env=env, timeout=3600)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    rows = summarize(ranks, args.size)
    command = "python benchmarks/bench_megatron.py" + (
        f" --size {args.size}" if args.size != "medium" else ""
    )
    moved = {k: ranks[0][k] for k in ("import_s", "export_s") if k in ranks[0]}
    path = write_results("bench_megatron", rows, {"command": command, **moved}, args.out)
    cols = ["change", "state_MB", "tenplex_save_s", "tenplex_load_s", "megatron_save_s", "megatron_load_s",
            "x_megatron", "first_megatron_save_s", "first_x_megatron"]  # fmt: skip
    print_rows(f"Megatron resharding ({path})", rows, cols)
    print("without the model, one process:", ", ".join(f"{k} {v:.3f}" for k, v in moved.items()))
    return 0 if all(not r["bad"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
