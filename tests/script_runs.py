"""A user's script trained under `tenplex run --script` and the same script on one device, compared: the
shared half of the third-party model tests (torchtitan, Hugging Face)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from outputs import failure
from tenplex.runtime.report import losses, timeline

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, schedule: Path, steps: int, run_dir: Path) -> subprocess.CompletedProcess:
    args = ["run", "--script", script, "--schedule", str(schedule), "--steps", str(steps),
            "--snapshot-every", "2", "--job", run_dir.name, "--run-dir", str(run_dir), "--quiet"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "tenplex.cli.main", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=800)


def elastic_and_static(
    script: str, schedule: Path, steps: int, tmp: Path, name: str, tolerance: float
) -> list:
    """Runs `script` through `schedule` and on one device; checks every step's loss against the static
    run's within `tolerance` and the ledger; returns the elastic run's timeline for case checks."""
    static_schedule = tmp / "static.json"
    static_schedule.write_text(json.dumps([{"step": 0, "devices": 1}]))
    r = run(script, schedule, steps, tmp / f"{name}-elastic")
    assert r.returncode == 0, failure(r)
    s = run(script, static_schedule, steps, tmp / f"{name}-static")
    assert s.returncode == 0, failure(s)

    recs = timeline(tmp / f"{name}-elastic")
    elastic, static = losses(recs), losses(timeline(tmp / f"{name}-static"))
    assert sorted(elastic) == sorted(static) == list(range(1, steps + 1))
    diff = max(abs(elastic[k] - static[k]) for k in static)
    assert diff < tolerance, diff
    summary = json.loads((tmp / f"{name}-elastic" / "summary.json").read_text())
    assert summary["ledger"]["ok"] and summary["ledger"]["replayed_steps"]
    assert "every sample exactly once" in r.stdout
    assert any(x["kind"] == "recover" and x["lost_steps"] > 0 for x in recs)
    return recs
