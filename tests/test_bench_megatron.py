"""benchmarks/bench_megatron.py end to end on the tiny size: two real gloo ranks, a real store, Megatron's
own dist_checkpointing beside tenplex on the same state, every loaded tensor checked bitwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from outputs import failure

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_both_paths_reshard_the_same_state_bit_for_bit_and_are_timed(tmp_path):
    out = tmp_path / "megatron.json"
    argv = [
        sys.executable,
        "benchmarks/bench_megatron.py",
        "--size",
        "tiny",
        "--rounds",
        "2",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, failure(done)
    doc = json.loads(out.read_text())
    assert doc["import_s"] > 0 and doc["export_s"] > 0  # the exported folder was checked: in the rows' bad
    rows = doc["rows"]
    assert [r["change"] for r in rows] == ["tp2 → dp2 × tp1", "tp2 → pp2"]
    for r in rows:
        assert r["bad"] == [] and r["rounds"] == 2 and r["state_MB"] > 0.1
        for k in ("tenplex_save_s", "tenplex_load_s", "megatron_save_s", "megatron_load_s"):
            assert r[k] > 0 and r[f"first_{k}"] > 0
        assert r["x_megatron"] == pytest.approx(r["megatron_total_s"] / r["tenplex_total_s"])
