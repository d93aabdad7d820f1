"""A Megatron-core GPTModel trained under `tenplex run --script` through tp, pp and dp changes and a
failure: losses equal a static one-rank run's, every sample once."""

from __future__ import annotations

import pytest

from script_runs import ROOT, elastic_and_static

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

SCRIPT = ROOT / "examples" / "megatron_gpt.py"
SCHEDULE = ROOT / "examples" / "megatron_schedule.yaml"
STEPS = 10
# tp 2, pp 2, dp 3 and one rank sum in different orders: fp32 round-off only
LOSS_TOLERANCE = 2e-6

pytestmark = pytest.mark.dist


def test_megatron_gpt_survives_tp_pp_and_dp_changes_and_a_failure(tmp_path):
    recs = elastic_and_static(str(SCRIPT), SCHEDULE, STEPS, tmp_path, "megatron", LOSS_TOLERANCE)
    layouts = [x["layout"] for x in recs if x["kind"] == "worker" and x["event"] == "ready"]
    assert layouts == ["dp1-tp2-pp1", "dp1-tp2-pp2", "dp3-tp1-pp1", "dp1-tp1-pp1"], layouts
    loaded = [x for x in recs if x["kind"] == "worker" and x["event"] == "loaded"]
    assert all(x["source"] == "memory" for x in loaded) and len(loaded) == 3, loaded
