"""The reconfiguration model (tenplex.planner.estimate): checked against every measured point, its costs and
docs tables generated from results/, and `tenplex plan --estimate` on the command line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tenplex.cli.main import main
from tenplex.planner import plan
from tenplex.planner.estimate import GB, LINKS, Links, demand, estimate, packaged_costs
from tenplex.ptc import PRESETS, gpt_ptc

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("reconfig_model", ROOT / "scripts" / "reconfig_model.py")
assert _spec and _spec.loader
model = sys.modules["reconfig_model"] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up
_spec.loader.exec_module(model)


@pytest.fixture(scope="module")
def points() -> list[dict]:
    return model.points()


def test_the_shipped_costs_are_the_ones_the_results_give():
    measured = model.cases()
    assert packaged_costs() == model.calibrate(measured, model.load_results(model.FULL)["machine"]["cpus"])


def test_the_model_is_within_25_percent_of_every_measured_point_but_the_named_misses(points):
    off = [p for p in points if not p["miss"] and abs(p["error"]) > model.BOUND]
    assert not off, [(p["file"], p["change"], p["hosts"], round(p["error"], 3)) for p in off]
    checked = [p for p in points if not p["miss"]]
    assert len(checked) >= 21  # all 16 loopback points and 5 of the 6 namespace points


def test_the_named_misses_are_measured_and_still_missed(points):
    missed = {(p["file"], p["name"] or p["change"], p["hosts"]): p for p in points if p["miss"]}
    assert set(missed) == set(model.MISSES)  # a miss that is no longer measured is no longer listed
    for p in missed.values():
        assert abs(p["error"]) > model.BOUND, p  # still a miss: once fixed, unlist it
        if p["file"] != model.SWEEP:
            assert p["error"] < 0, p  # the 8-host point: an under-prediction


def test_the_model_is_checked_on_every_point_of_the_scale_sweep_and_misses_only_named_ones(points):
    doc = model.load_results(model.SWEEP)
    swept = {p["name"]: p for p in points if p["file"] == model.SWEEP}
    assert set(swept) == {r["name"] for r in doc["rows"] if r["status"] == "ok"}
    assert max(p["hosts"] for p in swept.values()) >= 2 and len(swept) >= 5
    off = [
        (n, f"{p['error']:+.0%}") for n, p in swept.items() if not p["miss"] and abs(p["error"]) > model.BOUND
    ]
    assert not off, off
    assert all(r["why"] for r in doc["rows"] if r["status"] != "ok")  # a point not measured says why


def test_costs_docs_table_and_70b_description_match_the_generator():
    done = subprocess.run(
        [sys.executable, "scripts/reconfig_model.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_link_bound_change_takes_the_busiest_link_plus_the_fixed_costs():
    cfg = PRESETS["gpt3-1.3b"]
    p = plan(gpt_ptc(cfg, 1, 4, 2, devices_per_host=4), gpt_ptc(cfg, 2, 4, 2, devices_per_host=4))
    slow = Links("1 Gbit/s", 0.125)
    e, d = estimate(p, slow), demand(p)
    busiest = max(max(d.ingress[h], d.egress[h]) for h in d.ingress)
    fixed = estimate(plan(p.old, p.old), slow).load_s  # nothing moves: the fixed cost alone
    assert e.bottleneck.endswith("link")
    assert e.load_s == pytest.approx(busiest / (0.125 * GB) + fixed, rel=0.02)
    assert estimate(p, LINKS["400g"]).total_s <= estimate(p, LINKS["100g"]).total_s < e.total_s


def test_every_estimate_names_its_assumptions_and_costs():
    cfg = PRESETS["gpt3-125m"]
    e = estimate(plan(gpt_ptc(cfg, 1, 2, 1), gpt_ptc(cfg, 1, 4, 1)), LINKS["100g"])
    said = " ".join(e.assumptions)
    assert "12.5 GB/s per host" in said and "PCIe" in said
    assert all(src in said for src in packaged_costs().sources)


ARGS = ["plan", "--model", "gpt3-1.3b", "--from", "dp=1,tp=4,pp=2", "--to", "dp=2,tp=4,pp=2"]


def test_plan_estimate_json_has_a_projection_per_link(capsys):
    assert main([*ARGS, "--devices-per-host", "4", "--estimate", "--bandwidth", "100g,200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["estimate"]
    assert set(out) == {"100g", "200"}
    assert out["200"]["total_s"] == pytest.approx(out["200"]["save_s"] + out["200"]["load_s"])
    assert out["200"]["total_s"] <= out["100g"]["total_s"]


def test_plan_estimate_prints_the_table_and_its_assumptions(capsys):
    assert main([*ARGS, "--estimate"]) == 0
    out = capsys.readouterr().out
    assert "projected reconfiguration time" in out and "assumptions:" in out and "NVLink" in out


@pytest.mark.parametrize("bad", ["fast", "0", "-5", "inf", ","])
def test_a_bad_bandwidth_is_one_line_and_exit_2(bad, capsys):
    assert main([*ARGS, "--estimate", "--bandwidth", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tenplex: error: --bandwidth") and err.count("\n") == 1


def test_bandwidth_without_estimate_is_an_error(capsys):
    assert main([*ARGS, "--bandwidth", "400g"]) == 2
    assert "add --estimate" in capsys.readouterr().err
