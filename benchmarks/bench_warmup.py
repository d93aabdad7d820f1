"""What the zygote's DTensor warm-up (`tenplex.train.warmup`) saves a rank forked from it.

Each probe is a fresh process that imports what the zygote imports (torch, its distributed parts,
tenplex's rank), then, for `warm`, runs `warm_up()` as the zygote does before it forks; then, on a "fake"
world of 2 with a new mesh, it builds the tiny GPT with tp=2, its AdamW and its job state (`build`), and
trains one step (`first_step`) and another (`second_step`). The baseline, `cold`, is the same probe
without the warm-up, in the same run; the two alternate, and the median of `--repeat` probes counts.
What the warm-up cannot save is per mesh (DTensor's caches are keyed on it): compare `first_step` with
`second_step`.

    python benchmarks/bench_warmup.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import print_rows, write_results

PARTS = ("build", "first_step", "second_step")


def probe(warm: bool) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.pipelining
    import torch.distributed.tensor.parallel
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import tenplex.runtime.reference_rank  # noqa: F401
    from tenplex.data.sampler import ElasticSampler
    from tenplex.ptc import PRESETS
    from tenplex.ptc.layout import Layout
    from tenplex.train.optim import build_optimizer, build_scheduler
    from tenplex.train.parallel import build_mesh, build_model
    from tenplex.train.state import job_state
    from tenplex.train.warmup import warm_up

    if warm:
        warm_up()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    cfg, layout = PRESETS["tiny"], Layout(1, 2, 1)
    t = time.perf_counter()
    gpt = build_model(cfg, layout, build_mesh(layout, "cpu"), seed=1, device=torch.device("cpu"))
    optimizer = build_optimizer(gpt, lr=1e-3)
    scheduler = build_scheduler(optimizer, warmup=1, total=3)
    job_state(gpt, optimizer, scheduler, ElasticSampler(cfg.seq * 4, 2), 0)
    out = {"build": time.perf_counter() - t}
    x = torch.ones(2, cfg.seq, dtype=torch.long)
    for part in PARTS[1:]:
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(gpt(x).reshape(-1, cfg.vocab).float(), x.reshape(-1)).backward()
        optimizer.step()
        scheduler.step()
        out[part] = time.perf_counter() - t
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--probe", choices=("cold", "warm"), help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe == "warm")))
        return
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(args.repeat):
        for mode in runs:
            cmd = [sys.executable, __file__, "--probe", mode]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the zygote runs
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for mode, seen in runs.items():
        row = {"mode": mode, **{f"{k}_s": statistics.median(r[k] for r in seen) for k in PARTS}}
        row["probes"] = seen
        rows.append(row)
    cold, warm = rows
    warm["x_build"] = cold["build_s"] / warm["build_s"]
    warm["x_first_step"] = cold["first_step_s"] / warm["first_step_s"]
    print_rows("tiny GPT, tp=2 on a fake world of 2 (median of probes; x_: cold / warm)", rows,
               ["mode", "build_s", "first_step_s", "second_step_s", "x_build", "x_first_step"])  # fmt: skip
    command = "python benchmarks/bench_warmup.py" + (f" --repeat {args.repeat}" if args.repeat != 3 else "")
    meta = {"command": command, "repeat": args.repeat}
    print("wrote", write_results("bench_warmup", rows, meta, args.out))


if __name__ == "__main__":
    main()
