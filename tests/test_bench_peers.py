"""benchmarks/bench_peers.py end to end on a tiny state: real stores, a real 4-rank gloo world, torchft's real
transports; a peer that cannot run is named with its reason, never dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from outputs import failure

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers_bytecheckpoint import run_bytecheckpoint  # noqa: E402


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_recovery_runs_every_peer_on_the_same_state_and_checks_it(tmp_path):
    pytest.importorskip("torchft", reason="the peers extra is not installed")
    out = tmp_path / "peers.json"
    argv = [sys.executable, "benchmarks/bench_peers.py", "--size", "fixed", "--cases", "recovery",
            "--repeat", "1", "--http-chunks", "0,2", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, failure(done)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["bad"] == [] and "torchft_why" not in row
    assert row["received_GB"] == pytest.approx(row["state_GB"])  # the rejoining replica got all of it
    for system in ("tenplex_load_s", "http_0_s", "http_2_s", "pg_s", "dcp_shm_load_s", "dcp_disk_load_s"):
        assert row[system] > 0
    assert row["http_best_chunks"] in (0, 2)
    assert row["x_pg"] == pytest.approx(row["pg_s"] / row["tenplex_load_s"])


def test_a_missing_bytecheckpoint_venv_is_recorded_with_its_reason(tmp_path):
    row = run_bytecheckpoint(str(tmp_path / "no-venv" / "python"), "fsdp", {}, tmp_path, 1, 10)
    assert set(row) == {"bytecheckpoint_why"}
    assert "torch<=2.5.0" in row["bytecheckpoint_why"] and "pip install" in row["bytecheckpoint_why"]
