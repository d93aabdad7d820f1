"""`tenplex run`'s schedule on its two engines, in one run: the local controller (ranks started ahead of a
planned change, built and rehearsed while the old layout trains) and agents (`runtime/agent_run.py`: one
`tenplex agent` per emulated host, the schedule played by the driver), the agents twice: as they run by
default (a change planned at a step handed to workers built ahead) and with `--no-ahead` (every round to
the kept workers once they saved: the baseline of what building ahead buys). The demo's schedule (dp, tp
and pp changes, a redeploy, a failed device, a scale-in), the reference workload on loopback hosts, the
same settings for all.

Downtime by one definition for all, from each run's timeline: from the old phase's last step record to
the new phase's first, less the new phase's median step. Also: each run's wall time, its data ledger,
and how far its losses are from the controller's.

    python benchmarks/bench_runtimes.py          # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from common import print_rows, step_gaps, write_results
from tenplex.runtime.agent_run import AgentRun
from tenplex.runtime.demo import SCHEDULE
from tenplex.runtime.runconfig import REFERENCE, REFERENCE_SNAPSHOT_EVERY, RunConfig
from tenplex.runtime.schedule import parse_schedule
from tenplex.train.config import TrainConfig

STEPS = 60


def one(engine: str, base: Path) -> dict[str, Any]:
    run_dir = base / engine
    shutil.rmtree(run_dir, ignore_errors=True)
    train = TrainConfig(**{**REFERENCE, "model": "tiny", "global_batch": 12, "steps": STEPS})
    cfg = RunConfig(train, parse_schedule(SCHEDULE), STEPS, run_dir, job=f"bench-{engine}",
                    snapshot_every=REFERENCE_SNAPSHOT_EVERY, quiet=True,
                    ahead=engine != "agents-no-ahead")  # fmt: skip
    t = time.monotonic()
    if engine.startswith("agents"):
        s = AgentRun(cfg).run()
    else:
        from tenplex.runtime.controller import Controller
        from tenplex.runtime.report import summary

        ctl = Controller(cfg)
        try:
            ctl.run()
        finally:
            ctl.hosts.shutdown()
        s = summary(run_dir)
    return {"summary": s, "wall_s": time.monotonic() - t, "gaps": step_gaps(run_dir)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-runtimes-"))
    found = {e: one(e, base) for e in ("controller", "agents", "agents-no-ahead")}
    ctl, ag, kept = found["controller"], found["agents"], found["agents-no-ahead"]
    changes = [r["change"] for r in ctl["summary"]["reconfigurations"]]
    rows = []
    for i, change in enumerate(changes):
        c, a, k = ctl["gaps"][i], ag["gaps"][i], kept["gaps"][i]
        parts = ag["summary"]["reconfigurations"][i]["parts"]
        rows.append({"change": change, "step": ctl["summary"]["reconfigurations"][i]["step"],
                     "controller_s": c, "agents_s": a, "agents_no_ahead_s": k, "x_controller": c / a,
                     "x_no_ahead": k / a,
                     "agent_parts": {k: round(v, 4) for k, v in parts.items()}})  # fmt: skip
    lc = ctl["summary"]["losses"]
    meta = {
        "command": "python benchmarks/bench_runtimes.py",
        "network": "loopback",
        "steps": STEPS,
        "wall_s": {e: round(f["wall_s"], 1) for e, f in found.items()},
        "ledger_ok": {e: f["summary"]["ledger"]["ok"] for e, f in found.items()},
        "landed": {e: [r["step"] for r in f["summary"]["reconfigurations"]] for e, f in found.items()},
        "max_loss_diff": max(abs(f["summary"]["losses"][k] - lc[k]) for f in (ag, kept) for k in lc),
    }
    print_rows("downtime per change (s), one definition", rows,
               ["change", "step", "controller_s", "agents_s", "agents_no_ahead_s", "x_controller",
                "x_no_ahead"])  # fmt: skip
    print({k: v for k, v in meta.items() if k != "command"})
    print(write_results("bench_runtimes", rows, meta, args.out))
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
