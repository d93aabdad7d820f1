"""benchmarks/bench_sweep.py: a tiny sweep end to end (real stores, real gloo worlds of 4 and 8 ranks, every
load checked bit for bit), and what it does with a point that fails, runs past the budget or would not fit."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from outputs import failure

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_sweep  # noqa: E402


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_quick_sweep_fits_a_line_per_series_and_checks_every_load(tmp_path):
    # about 70 s of 2 idle cores (most of it 16 ranks' interpreters starting); minutes on a loaded machine
    out = tmp_path / "sweep.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "benchmarks/bench_sweep.py", "--quick", "--out", str(out)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert done.returncode == 0, failure(done)
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["ranks"], r["gb"]) for r in rows] == [(4, 0.005), (4, 0.05), (8, 0.005)]
    for r in rows:
        assert r["status"] == "ok" and r["bad"] == [], r.get("why")
        assert r["save_s"] > 0 and r["load_s"] > 0 and r["first_save_s"] > 0 and r["first_load_s"] > 0
        assert r["x_floor"] > 1 and r["dcp_shm_total_s"] > 0
        assert r["peak_GB"] > r["state_GB"]  # the ranks' state alone is more than the state
        assert r["store_held_per_byte"] >= r["saved_GB"] / r["state_GB"]  # at least the snapshot it holds
    assert rows[2]["series"] == ["ranks"] and "size" in rows[0]["series"] and "ranks" in rows[0]["series"]
    fit = doc["fits"]["size 4 ranks"]
    for kind in ("save", "load", "first_save", "first_load"):
        assert np.isfinite(fit[kind]["slope_s_per_GB"]) and np.isfinite(fit[kind]["intercept_s"])
    assert doc["stopped_by_budget"] is False and doc["peak_per_GB"] > 1


def args(**kw) -> argparse.Namespace:
    base = dict(sizes=None, max_gb=1.2, ranks="4", rank_gb=0.6, network="loopback", hosts="2", host_gb=0.3,
                budget_min=15.0, timeout=900.0, repeat=2, no_dcp=True, store_memory="1GiB",
                nic_gbps=1.0)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_points_past_the_budget_are_recorded_as_skipped_with_the_reason(tmp_path):
    rows = bench_sweep.sweep(args(budget_min=0), bench_sweep.plan_points(args()), tmp_path)
    assert len(rows) == 4 and all(r["status"] == "skipped" for r in rows)  # 5 MB, 0.3, 0.6 (shared), 1.2
    assert all("past the budget of 0 minutes" in r["why"] for r in rows)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_a_point_that_fails_is_a_knee_with_its_reason_and_the_sweep_goes_on(tmp_path):
    a = args(sizes="0.005,0.005", ranks="4", rank_gb=0.005, timeout=1.0)  # 1 s: the ranks are killed
    rows = bench_sweep.sweep(a, bench_sweep.plan_points(a), tmp_path)
    assert [r["status"] for r in rows] == ["failed"]  # one point, in both series
    assert "failed" in rows[0]["why"] or "ranks" in rows[0]["why"]
    (knee,) = bench_sweep.knees(rows)
    assert knee["why"].startswith("failed: ") and knee["point"] == rows[0]["name"]


def test_a_point_whose_seconds_per_gb_grow_past_20_percent_is_a_knee():
    def row(gb: float, s_per_gb: float) -> dict:
        return {"name": f"{gb} GB", "status": "ok", "series": ["size"], "gb": gb, "s_per_GB": s_per_gb}

    knees = bench_sweep.knees([row(0.005, 9.0), row(0.3, 1.0), row(0.6, 1.19), row(1.2, 1.3)])
    assert [k["point"] for k in knees] == ["1.2 GB"] and knees[0]["ratio"] == pytest.approx(1.3)


def test_a_size_predicted_past_the_memory_limit_is_skipped_with_its_prediction():
    done = [
        {"status": "ok", "ranks": 4, "hosts": 2, "gb": 0.005, "peak_GB": 1.0, "state_GB": 0.005},
        {"status": "ok", "ranks": 4, "hosts": 2, "gb": 0.3, "peak_GB": 2.2, "state_GB": 0.3},
    ]
    point = {"ranks": 4, "hosts": 2, "gb": 2.4}  # 1 GB + 4 bytes a byte of state: 10.6 GB
    assert bench_sweep.too_big(point, done, limit=int(20e9)) is None
    why = bench_sweep.too_big(point, done, limit=int(8e9))
    assert why and why.startswith("predicted peak 9.9 GiB (1.00 GB + 4.00 bytes a byte of state)")


def test_the_ladder_and_the_models_it_builds():
    assert bench_sweep.ladder(1.2) == [0.005, 0.3, 0.6, 1.2]
    for gb in (0.3, 0.6, 1.2, 2.4):
        got = bench_sweep.GPTConfig(**bench_sweep.model_for(gb)).param_count() * 12e-9
        assert got == pytest.approx(gb, rel=0.1)
    assert bench_sweep.change(16) == ([1, 16, 1], [2, 4, 2])
