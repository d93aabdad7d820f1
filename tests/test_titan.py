"""torchtitan's Llama 3 (its own model code and parallelize_llama: FSDP2 + TP, `_StridedShard`) trained
under `tenplex run --script` through a tp change, a dp change and a failure; losses equal a static run's."""

from __future__ import annotations

import pytest

from script_runs import ROOT, elastic_and_static

pytest.importorskip("torchtitan", reason="the titan extra is not installed")


SCRIPT = ROOT / "examples" / "titan_llama.py"
SCHEDULE = ROOT / "examples" / "titan_schedule.yaml"
STEPS = 16
# measured: FSDP2 over 1, 2, 3 ranks and dp 2 x tp 2 sum in different orders; this schedule's losses left
# the static run's by at most 9.5e-7 (a per-rank mean loss instead of torchtitan's global one: 7e-3)
LOSS_TOLERANCE = 2e-6

pytestmark = pytest.mark.dist


def test_titan_llama_survives_a_tp_change_a_dp_change_and_a_failure(tmp_path):
    recs = elastic_and_static(f"{SCRIPT} --tp 4:2", SCHEDULE, STEPS, tmp_path, "titan", LOSS_TOLERANCE)
    layouts = [x["layout"] for x in recs if x["kind"] == "worker" and x["event"] == "ready"]
    assert layouts == ["dp2-tp2-fsdp", "dp2-tp1-fsdp", "dp3-tp1-fsdp", "dp2-tp1-fsdp"], layouts
    loaded = [x for x in recs if x["kind"] == "worker" and x["event"] == "loaded"]
    steps = [x["step"] for x in loaded]  # the failure at 12 resumes from the newest committed snapshot
    assert steps[:2] == [4, 8] and steps[2] in (8, 10), steps
    assert all(x["source"] == "memory" for x in loaded)
