"""A Megatron-core GPTModel trained under `tenplex run --script` through tp, pp and dp changes and a
failure: losses equal a static one-rank run's, every sample once. The per-phase loss table (each phase's
steps and its largest difference from the static run) is printed for the docs."""

from __future__ import annotations

import pytest

from script_runs import ROOT, elastic_and_static
from tenplex.runtime.history import losses, timeline

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

SCRIPT = ROOT / "examples" / "megatron_gpt.py"
SCHEDULE = ROOT / "examples" / "megatron_schedule.yaml"
STEPS = 10
# tp 2, pp 2, dp 3 and one rank sum in different orders: fp32 round-off only
LOSS_TOLERANCE = 2e-6

pytestmark = pytest.mark.dist


def loss_table(recs: list[dict], static: dict[int, float]) -> list[dict]:
    """Per phase (in timeline order): its layout, the steps it ran and their largest |elastic - static|."""
    rows: list[dict] = []
    for r in recs:
        if r["kind"] == "worker" and r["event"] == "ready":
            rows.append({"layout": r["layout"], "steps": [], "max_diff": 0.0})
        elif r["kind"] == "worker" and r["event"] == "step" and rows:
            row = rows[-1]
            row["steps"].append(r["step"])
            row["max_diff"] = max(row["max_diff"], abs(r["loss"] - static[r["step"]]))
    return rows


def test_megatron_gpt_survives_tp_pp_and_dp_changes_and_a_failure(tmp_path):
    recs = elastic_and_static(str(SCRIPT), SCHEDULE, STEPS, tmp_path, "megatron", LOSS_TOLERANCE)
    layouts = [x["layout"] for x in recs if x["kind"] == "worker" and x["event"] == "ready"]
    assert layouts == ["dp1-tp2-pp1", "dp1-tp2-pp2", "dp3-tp1-pp1", "dp1-tp1-pp1"], layouts
    loaded = [x for x in recs if x["kind"] == "worker" and x["event"] == "loaded"]
    assert all(x["source"] == "memory" for x in loaded) and len(loaded) == 3, loaded
    static = losses(timeline(tmp_path / "megatron-static"))
    rows = loss_table(recs, static)
    assert [r["layout"] for r in rows] == layouts and sum(len(r["steps"]) for r in rows) >= STEPS
    print("\n| phase | layout | steps | max abs loss diff vs static |\n|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        steps = f"{r['steps'][0]}-{r['steps'][-1]}" if r["steps"] else "-"
        print(f"| {i} | {r['layout']} | {steps} | {r['max_diff']:.2e} |")
    print(f"overall max: {max(r['max_diff'] for r in rows):.2e} (static losses: {static})")
