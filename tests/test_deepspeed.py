"""DeepSpeed ZeRO engines through tenplex: a snapshot written under one stage and dp size loads into another,
and DeepSpeed's own gathered fp32 weights and Adam moments are bit for bit the saved ones
(tests/deepspeed_cases.py is the worker; real gloo ranks, a real store daemon)."""

from __future__ import annotations

import os

import pytest

from launch import run_ranks
from script_runs import ROOT, elastic_and_static
from tenplex.runtime.report import losses, timeline

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

pytestmark = pytest.mark.dist

# measured: a step after the change sums the gradients of 1-3 ranks in another order
STEP_LOSS_TOLERANCE = 1e-6
SCRIPT = ROOT / "examples" / "deepspeed_charlm.py"
SCHEDULE = ROOT / "examples" / "deepspeed_schedule.yaml"
# measured: ZeRO on 1-3 ranks reduces gradients in different orders; the losses left the static run's by
# at most 4.8e-7 (examples/deepspeed_schedule.yaml, 12 steps)
LOSS_TOLERANCE = 2e-6


@pytest.fixture(scope="session", autouse=True)
def torch_extensions(tmp_path_factory):
    """DeepSpeed compiles a C++ op for its CPU communication on first use (~60 s): once per test run, into
    one directory every rank and every test's processes share (or the one $TORCH_EXTENSIONS_DIR names)."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.getbasetemp() / "torch_extensions")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return os.environ["TORCH_EXTENSIONS_DIR"]


def ranks(world: int, store, tmp_path, mode: str, cases: str) -> list[dict]:
    """Every case's result on rank 0 (the cases, built one after the other in one world of `world`)."""
    env = {"TENPLEX_STORE": store.url, "DS_MODE": mode, "DS_CASES": cases, "DS_JOB": tmp_path.name,
           "DS_REF": str(tmp_path / "ref.pt")}  # fmt: skip
    out = run_ranks("deepspeed_cases", world, env=env, timeout=300)
    return [dict(r, everyone=[x["cases"][i] for x in out]) for i, r in enumerate(out[0]["cases"])]


def check_load(r: dict) -> None:
    assert "error" not in r, r["message"]
    assert r["step"] == 3 and r["global_steps"] == 3
    assert len(r["names"]) == 15 and r["differ"] == [], r["differ"]  # 5 parameters x (master, 2 moments)
    assert r["adam_step"] and set(r["adam_step"]) == {3.0}
    loss, saved = r["next_loss"]
    assert loss == saved, (loss, saved)  # the same weights: the same loss, bit for bit
    loss, saved = r["step_loss"]
    assert abs(loss - saved) < STEP_LOSS_TOLERANCE, loss - saved
    assert all(x["next_loss"] == r["next_loss"] for x in r["everyone"])


# (the stage saved under on 2 ranks, {ranks: the stages loaded in turn}): every stage and dp size 1-3
@pytest.mark.parametrize(("saved", "loads"), [(2, {3: "2,3", 1: "2,0"}), (3, {3: "3,1", 1: "3"})])
def test_a_zero_snapshot_loads_bit_for_bit_into_other_dp_sizes_and_stages(store, tmp_path, saved, loads):
    (out,) = ranks(2, store, tmp_path, "save", str(saved))
    assert "error" not in out, out["message"]
    for world, stages in loads.items():
        for r in ranks(world, store, tmp_path, "load", stages):
            check_load(r)


def test_a_snapshot_of_another_model_is_a_clear_error(store, tmp_path):
    (out,) = ranks(2, store, tmp_path, "save", "1")
    assert "error" not in out, out["message"]
    (out,) = ranks(1, store, tmp_path, "load", "3/14")  # the first Linear 14 wide instead of 13
    assert out["error"] == "ShapeMismatchError", out
    assert "master.2." in out["message"] and "in the snapshot but" in out["message"]


def test_deepspeed_charlm_survives_scale_out_a_killed_rank_and_scale_in_changing_stage(tmp_path):
    """ZeRO-2 on 2 ranks -> ZeRO-3 on 3 -> a killed rank (ZeRO-2 on the 2 left) -> ZeRO-1 on 1, against
    a static run on one rank (ZeRO-1): the same losses, every sample once."""
    script = f"{SCRIPT} --stages 3:3,1:1"
    recs = elastic_and_static(script, SCHEDULE, 12, tmp_path, "ds", LOSS_TOLERANCE)
    assert [len(x["devices"]) for x in recs if x["kind"] == "launch"] == [2, 3, 2, 1]
    loaded = [x for x in recs if x["kind"] == "worker" and x["event"] == "loaded"]
    assert [x["step"] for x in loaded] == [4, 6, 9] and all(x["source"] == "memory" for x in loaded)
    layouts = [x["layout"] for x in recs if x["kind"] == "worker" and x["event"] == "ready"]
    assert layouts == ["zero2-dp2", "zero3-dp3", "zero2-dp2", "zero1-dp1"], layouts
    elastic, static = losses(recs), losses(timeline(tmp_path / "ds-static"))
    print("max loss difference", max(abs(elastic[k] - static[k]) for k in static))
