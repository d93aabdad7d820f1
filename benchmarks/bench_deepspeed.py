"""Reshard times against DeepSpeed's own path: the same ZeRO state moved from dp 2 to dp 3 (and 1).

The model is the example's (examples/deepspeed_charlm.py: embedding, two linear layers) with its hidden
width chosen so that the fp32 master weights and Adam's two moments hold about `--size` MB; AdamW under
ZeRO (`--stage`, default 2) over gloo on the CPU, one training step before the saves. Two paths, timed in
the same run on the same state:

- tenplex: `tenplex.save(DeepSpeedState(engine)())` on the old ranks, `tenplex.load` + `restore` on the
  new ones (the store daemon holds the snapshot in memory);
- DeepSpeed: `engine.save_checkpoint` to /dev/shm on the old ranks, `ds_to_universal` (its `main`, called
  in this process with its default workers; the import is not timed), `engine.load_checkpoint` with
  `"checkpoint": {"load_universal": true}` on the new ones.

Each load is checked: the fp32 weights and both Adam moments DeepSpeed itself gathers (`safe_get_full_*`)
bit for bit the saved ones. Every timed part runs between barriers (the slowest rank's time). `--repeat
R` saves and loads R times: `first_*` is the first (connections, allocations), the others' median the
steady state; `x_ds` = DeepSpeed's save + convert + load / tenplex's save + load.

    python benchmarks/bench_deepspeed.py [--size 8[,96]] [--changes 2-3,2-1] [--repeat 3] [--stage 2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from common import entry, print_rows, write_results

ROOT = Path(__file__).resolve().parents[1]
CONTEXT, EMBED, VOCAB, BATCH = 16, 32, 256, 12
COLUMNS = [
    *("change", "stage", "state_MB", "tenplex_save_s", "tenplex_load_s", "tenplex_s", "ds_save_s"),
    *("ds_convert_s", "ds_load_s", "ds_s", "x_ds", "first_tenplex_s", "first_ds_s", "first_x_ds", "bitwise"),
]


def width_for(size_mb: float) -> int:
    """The hidden width whose parameters x 12 bytes (fp32 master, exp_avg, exp_avg_sq) are about `size_mb`."""
    per_unit = EMBED * CONTEXT + 1 + VOCAB  # one hidden unit: a row of the first layer, its bias, a column
    return max(1, round((size_mb * 1e6 / 12 - VOCAB * EMBED - VOCAB) / per_unit))


def engine_for(world: int, stage: int, width: int, seed: int, universal: bool = False) -> Any:
    import deepspeed
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(VOCAB, EMBED),
        nn.Flatten(),
        nn.Linear(EMBED * CONTEXT, width),
        nn.GELU(),
        nn.Linear(width, VOCAB),
    )
    config = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 8, "warmup_max_lr": 3e-3}},
        "checkpoint": {"load_universal": universal},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def gathered(engine: Any) -> dict[str, Any]:
    """The full fp32 weights and Adam moments as DeepSpeed assembles them (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        out[f"master.{name}"] = safe_get_full_fp32_param(p).clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{name}"] = safe_get_full_optimizer_state(p, k).clone()
    return out


def timed(fn: Any) -> float:
    """Seconds from a barrier to the barrier after `fn` on every rank: the slowest rank's time."""
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - started


def train_one_step(engine: Any, world: int, rank: int) -> None:
    """One step on random tokens: Adam's moments exist and differ from the weights."""
    import torch
    from torch import nn

    tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    part = tokens.chunk(world)[rank]
    engine.backward(nn.functional.cross_entropy(engine(part[:, :CONTEXT]), part[:, CONTEXT]))
    engine.step()


def worker_save(cfg: dict) -> dict:
    """The old ranks: the reference state, then `repeat` saves by each path (one step number each)."""
    import torch
    import torch.distributed as dist

    import tenplex
    from tenplex.integrations.deepspeed import DeepSpeedState

    engine = engine_for(dist.get_world_size(), cfg["stage"], cfg["width"], seed=0)
    train_one_step(engine, dist.get_world_size(), dist.get_rank())
    full = gathered(engine)
    if dist.get_rank() == 0:
        torch.save(full, cfg["ref"])
    out: dict[str, list[float]] = {"tenplex_save_s": [], "ds_save_s": []}
    for i in range(1, cfg["repeat"] + 1):
        out["tenplex_save_s"].append(
            timed(lambda i=i: tenplex.save(DeepSpeedState(engine)(), job=cfg["job"], step=i))
        )
        out["ds_save_s"].append(timed(lambda i=i: engine.save_checkpoint(cfg["ckpt"], tag=f"global_step{i}")))
    engine.destroy()
    return out


def worker_load(cfg: dict) -> dict:
    """The new ranks: each path loads each saved step into its own fresh engine, checked bit for bit."""
    import torch
    import torch.distributed as dist

    import tenplex
    from tenplex.integrations.deepspeed import DeepSpeedState

    world = dist.get_world_size()
    ours, theirs = (engine_for(world, cfg["stage"], cfg["width"], 1, universal=u) for u in (False, True))
    ref = torch.load(cfg["ref"])
    out: dict[str, Any] = {"tenplex_load_s": [], "ds_load_s": [], "differ": []}

    def tenplex_load(i: int) -> None:
        state = DeepSpeedState(ours)
        sd = state()
        tenplex.load(sd, job=cfg["job"], step=i)
        state.restore(sd)

    for i in range(1, cfg["repeat"] + 1):
        out["tenplex_load_s"].append(timed(lambda i=i: tenplex_load(i)))
        out["ds_load_s"].append(
            timed(lambda i=i: theirs.load_checkpoint(cfg["universal"], tag=f"global_step{i}"))
        )
        for who, engine in (("tenplex", ours), ("deepspeed", theirs)):
            full = gathered(engine)
            out["differ"] += [f"{who} step {i}: {k}" for k, t in ref.items() if not torch.equal(full[k], t)]
    for engine in (ours, theirs):
        engine.destroy()
    return out


def worker(role: str) -> None:
    """One rank of `role`; rank 0 writes the result, then the process ends at once (ZeRO's C++ threads
    were seen to abort in the interpreter's teardown: tests/deepspeed_cases.py)."""
    import deepspeed
    import torch.distributed as dist

    cfg = json.loads(os.environ["BENCH_DS"])
    deepspeed.init_distributed(dist_backend="gloo")
    result = (worker_save if role == "save" else worker_load)(cfg)
    if dist.get_rank() == 0:
        Path(cfg["out"]).write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(role: str, world: int, cfg: dict, store_url: str) -> dict:
    from tenplex.util.ranks import RanksFailed, run_local

    env = dict(os.environ, TENPLEX_STORE=store_url, BENCH_DS=json.dumps(cfg), OMP_NUM_THREADS="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    try:
        run_local([sys.executable, __file__, "--worker", role], world, env=env, capture=True, timeout=900)
    except RanksFailed as e:
        tail = "\n".join(f"--- rank {r} ---\n{log[-3000:]}" for r, log in enumerate(e.logs))
        raise SystemExit(f"bench_deepspeed: {role} on {world} ranks failed\n{tail}") from None
    return json.loads(Path(cfg["out"]).read_text())


def convert(ckpt: Path, universal: Path, repeat: int) -> list[float]:
    """DeepSpeed's ds_to_universal for each saved step, as its command line runs it (defaults, stages 1-2
    need --inject_missing_state); its own printing kept out of the table."""
    from deepspeed.checkpoint import ds_to_universal

    out = []
    for i in range(1, repeat + 1):
        tag = f"global_step{i}"
        argv = ["--input_folder", str(ckpt / tag), "--output_folder", str(universal / tag)]
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
            mock.patch.object(sys, "argv", ["ds_to_universal", *argv, "--inject_missing_state"]),
        ):
            args = ds_to_universal.parse_arguments()
            started = time.perf_counter()
            ds_to_universal.main(args)
        out.append(time.perf_counter() - started)
    return out


def steady(xs: list[float]) -> float:
    return statistics.median(xs[1:] or xs)


def measure(change: str, args: argparse.Namespace, width: int, store_url: str) -> dict:
    """One change `OLD-NEW` (dp sizes): the saves on OLD ranks, the conversion, the loads on NEW ranks."""
    old, new = (int(x) for x in change.split("-"))
    with tempfile.TemporaryDirectory(prefix="bench-ds-", dir="/dev/shm") as tmp:
        cfg = {"stage": args.stage, "width": width, "repeat": args.repeat, "job": f"bench-{Path(tmp).name}",
               "ref": f"{tmp}/ref.pt", "ckpt": f"{tmp}/ckpt", "universal": f"{tmp}/universal",
               "out": f"{tmp}/out.json"}  # fmt: skip
        saved = launch("save", old, cfg, store_url)
        converted = convert(Path(cfg["ckpt"]), Path(cfg["universal"]), args.repeat)
        loaded = launch("load", new, cfg, store_url)
    ours = [s + load for s, load in zip(saved["tenplex_save_s"], loaded["tenplex_load_s"])]
    theirs = [s + c + load for s, c, load in zip(saved["ds_save_s"], converted, loaded["ds_load_s"])]
    params = VOCAB * EMBED + (EMBED * CONTEXT + 1) * width + (width + 1) * VOCAB
    row = {"change": f"dp {old}→{new}", "stage": args.stage, "state_MB": round(12 * params / 1e6, 1)}
    for name, xs in (*saved.items(), ("ds_convert_s", converted), *loaded.items()):
        if name != "differ":
            row[name] = round(steady(xs), 4)
    row |= {"tenplex_s": round(steady(ours), 4), "ds_s": round(steady(theirs), 4)}
    row |= {"x_ds": round(row["ds_s"] / row["tenplex_s"], 2), "first_tenplex_s": round(ours[0], 4)}
    row |= {"first_ds_s": round(theirs[0], 4), "first_x_ds": round(theirs[0] / ours[0], 2)}
    row |= {"bitwise": not loaded["differ"], "differ": loaded["differ"][:8]}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="8", help="MB of fp32 weights + Adam moments (about); comma-separated")
    p.add_argument("--changes", default="2-3,2-1", help="OLD-NEW dp sizes, comma-separated")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3), help="the ZeRO stage of both sides")
    p.add_argument("--repeat", type=int, default=3, help="saves and loads per path: the first, then steady")
    p.add_argument("--out", default=None, help="JSON results (default results/bench_deepspeed.json)")
    p.add_argument("--worker", choices=("save", "load"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
    from tenplex.store import start_store

    try:
        sizes = [float(x) for x in args.size.split(",")]
    except ValueError:
        p.error(f"--size {args.size!r}: expected MB figures such as 8,96")
    changes = args.changes.split(",")
    if not all(re.fullmatch(r"[1-9]\d*-[1-9]\d*", c) for c in changes):
        p.error(f"--changes {args.changes!r}: expected OLD-NEW dp sizes such as 2-3,2-1")
    held_mb = sum(sizes) * len(changes) * args.repeat * 1.5  # every saved step stays in the store
    store = start_store(memory_limit=f"{int(held_mb / 1000) + 1}GiB")
    try:
        rows = [measure(c, args, width_for(mb), store.url) for mb in sizes for c in changes]
    finally:
        store.stop()
    meta = {
        "size_MB": sizes,
        "repeat": args.repeat,
        "command": " ".join(["python benchmarks/bench_deepspeed.py", *sys.argv[1:]]),
    }
    out = write_results("bench_deepspeed", rows, meta, path=args.out)
    print_rows(f"reshard: tenplex vs DeepSpeed's universal checkpoint ({out})", rows, COLUMNS)
    if not all(r["bitwise"] for r in rows):
        raise SystemExit(f"bench_deepspeed: a load was not bit for bit: {[r['differ'] for r in rows]}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    entry(main)
