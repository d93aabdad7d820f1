"""A Hugging Face LlamaForCausalLM from a tiny config (nothing downloaded), FSDP2 over its decoder layers,
under `tenplex run --script` through scale-out, a killed rank and scale-in; losses equal a static run's."""

from __future__ import annotations

import pytest

from script_runs import ROOT, elastic_and_static

pytest.importorskip("transformers", reason="the hf extra is not installed")


SCRIPT = ROOT / "examples" / "hf_llama.py"
SCHEDULE = ROOT / "examples" / "hf_schedule.yaml"
STEPS = 12
# measured: FSDP2 over 1-4 ranks sums in different orders; this schedule's losses left the static run's
# by at most 4.8e-7
LOSS_TOLERANCE = 2e-6

pytestmark = pytest.mark.dist


def test_hf_llama_survives_scale_out_a_killed_rank_and_scale_in(tmp_path):
    recs = elastic_and_static(str(SCRIPT), SCHEDULE, STEPS, tmp_path, "hf", LOSS_TOLERANCE)
    assert [len(x["devices"]) for x in recs if x["kind"] == "launch"] == [2, 4, 3, 1]
    loaded = [x for x in recs if x["kind"] == "worker" and x["event"] == "loaded"]
    steps = [x["step"] for x in loaded]  # the kill at 6 resumes from the newest committed snapshot
    assert len(steps) == 3 and steps[0] == 4 and steps[1] in (4, 6) and steps[2] == 8, steps
    assert all(x["source"] == "memory" for x in loaded)
