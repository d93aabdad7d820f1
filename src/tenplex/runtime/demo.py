"""`tenplex demo`: an elastic job that changes dp, tp and pp, redeploys, survives a failure, and is then
compared step by step with a static run of the same steps."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..train.config import TrainConfig
from .controller import Controller, RunConfig
from .hosts import host_of
from .report import losses, plot, print_report, summary, timeline, write_json
from .runconfig import REFERENCE, REFERENCE_SNAPSHOT_EVERY
from .schedule import parse_schedule
from .validate import check_run

# 2 devices per emulated host; a global batch of 12 splits over dp = 1, 2, 3 and 4
SCHEDULE = [
    {"step": 0, "devices": 2, "layout": {"dp": 2}},
    {"step": 10, "devices": 4, "layout": {"tp": 2, "pp": 2}},
    {"step": 20, "devices": 4, "layout": {"dp": 2, "pp": 2}},
    {"step": 30, "redeploy": True, "layout": {"dp": 2, "tp": 2}},
    {"step": 43, "fail": [3]},
    {"step": 50, "devices": 2},
]
# Different layouts sum in different orders, so fp32 results drift apart with the steps, while a run that
# goes through a tenplex save/load in the same layout is bit-identical to one that does not. The tolerances
# are a few times the drift a static dp2 run shows against one device over these 60 steps
# (`pytest tests/test_runtime.py -k bit_for_bit -s` prints it, and the test holds it under them).
LOSS_TOLERANCE = 1e-5
PARAM_TOLERANCE = 5e-4


def compare_parameters(elastic: Controller, static: Controller) -> float:
    """Largest difference between the two runs' final parameters, read back from their stores."""
    from ..transformer.durable import assemble

    def final(ctl: Controller) -> dict:
        step = ctl._committed_step()
        url = ctl.hosts.allocation and ctl.hosts.store_url(host_of(ctl.hosts.allocation[0]))
        return assemble(ctl.cfg.job, step, store=url)[2]

    a, b = final(elastic), final(static)
    names = [n for n in a if n.startswith("model.")]
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in names)


def run_demo(
    run_dir: Path,
    model: str = "tiny",
    steps: int = 60,
    quiet: bool = False,
    network: str = "loopback",
    ahead: bool = True,
) -> bool:
    """With `network="netns"` the elastic run's hosts are network namespaces (the static run stays on
    loopback, in the controller's namespace); `ahead=False`: planned changes start no ranks ahead."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    train = TrainConfig(**{**REFERENCE, "model": model, "global_batch": 12, "steps": steps})
    elastic = RunConfig(
        train, parse_schedule(SCHEDULE), steps, run_dir / "elastic", job="demo",
        snapshot_every=REFERENCE_SNAPSHOT_EVERY,
        quiet=quiet, network=network, ahead=ahead,
    )  # fmt: skip
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
    check_run(elastic)
    on = " on namespace hosts" if network == "netns" else ""
    print(f"tenplex demo: elastic run (dp, tp and pp changes, a redeploy, a failure){on}")
    ctl, ref = Controller(elastic), Controller(static)
    try:
        ctl.run()
        print("tenplex demo: static run of the same steps on one device, for comparison")
        ref.run()
        params = compare_parameters(ctl, ref)
    finally:
        ref.hosts.shutdown()  # first: with namespace hosts, its stores run in the elastic run's namespace
        ctl.hosts.shutdown()
    reference = losses(timeline(static.run_dir))
    s = summary(elastic.run_dir, reference, LOSS_TOLERANCE)
    s["static"]["max_param_diff"] = params
    s["static"]["param_tolerance"] = PARAM_TOLERANCE
    s["static"]["match"] = s["static"]["match"] and params <= PARAM_TOLERANCE
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
