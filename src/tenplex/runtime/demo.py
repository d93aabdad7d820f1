"""`tenplex demo`: an elastic job that changes dp, tp and pp, redeploys, survives a failure, and is then
compared step by step with a static run of the same steps."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..train.config import TrainConfig
from .controller import Controller, RunConfig
from .report import losses, plot, print_report, summary, timeline, write_json
from .schedule import parse_schedule

# 2 devices per emulated host; a global batch of 12 splits over dp = 1, 2, 3 and 4
SCHEDULE = [
    {"step": 0, "devices": 2, "layout": {"dp": 2}},
    {"step": 10, "devices": 4, "layout": {"tp": 2, "pp": 2}},
    {"step": 20, "devices": 4, "layout": {"dp": 2, "pp": 2}},
    {"step": 30, "redeploy": True, "layout": {"dp": 2, "tp": 2}},
    {"step": 43, "fail": [3]},
    {"step": 50, "devices": 2},
]
LOSS_TOLERANCE = 2e-6  # the largest layout-to-layout loss difference measured for the reference workload, x4


def run_demo(run_dir: Path, model: str = "tiny", steps: int = 60, quiet: bool = False) -> bool:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    train = TrainConfig(
        model=model, global_batch=12, micro_batch=0, seed=0, lr=3e-3, warmup=5, steps=steps, device="cpu"
    )
    elastic = RunConfig(
        train, parse_schedule(SCHEDULE), steps, run_dir / "elastic", job="demo", snapshot_every=5, quiet=quiet
    )
    static = RunConfig(
        train,
        parse_schedule([{"step": 0, "devices": 1}]),
        steps,
        run_dir / "static",
        job="demo-static",
        snapshot_every=0,
        persist=False,
        quiet=True,
    )
    print("tenplex demo: elastic run (dp, tp and pp changes, a redeploy, a failure)")
    ctl = Controller(elastic)
    try:
        ctl.run()
    finally:
        ctl.cluster.shutdown()
    print("tenplex demo: static run of the same steps on one device, for comparison")
    ref = Controller(static)
    try:
        ref.run()
    finally:
        ref.cluster.shutdown()
    reference = losses(timeline(static.run_dir))
    s = summary(elastic.run_dir, reference, LOSS_TOLERANCE)
    png = plot(elastic.run_dir, run_dir / "demo.png", reference)
    write_json(run_dir / "summary.json", s)
    print_report(s)
    print(
        f"plot: {png}   timeline: {elastic.run_dir / 'timeline.jsonl'}   summary: {run_dir / 'summary.json'}"
    )
    return bool(s["ledger"]["ok"] and s["static"]["match"])


if __name__ == "__main__":
    import sys

    sys.exit(0 if run_demo(Path("runs/demo")) else 1)
