"""benchmarks/bench_small.py end to end with --quick: real stores, a real 2-rank gloo world, the Hugging Face
and torchtitan states, tenplex and DCP on the same ranks, every load checked bit for bit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from outputs import failure

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from memory_peak import descendants  # noqa: E402
from small_worker import check  # noqa: E402

PARTS = ("save", "load_same", "load_reshard")


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_quick_run_times_tenplex_and_dcp_on_the_same_states_and_checks_every_load(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    pytest.importorskip("torchtitan", reason="the titan extra is not installed")
    out = tmp_path / "small.json"
    argv = [sys.executable, "benchmarks/bench_small.py", "--quick", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, failure(done)
    doc = json.loads(out.read_text())
    assert doc["repeat"] == 3 and doc["command"].startswith("python benchmarks/bench_small.py --quick")
    rows = {r["state"]: r for r in doc["rows"]}
    assert set(rows) == {"hf", "titan", "tiny"} and {r["ranks"] for r in rows.values()} == {2}
    for name in ("hf", "titan"):
        r = rows[name]
        assert r["bad"] == [] and 60 <= r["tensors"] <= 200 and 0.5 < r["MB"] < 20, r
        for part in PARTS:
            assert r[f"tenplex_{part}_s"] > 0 and r[f"dcp_{part}_s"] > 0
            assert r[f"x_{part}"] == pytest.approx(r[f"tenplex_{part}_s"] / r[f"dcp_{part}_s"])
            assert r[f"tenplex_{part}_s"] <= r[f"tenplex_{part}_median_s"]
        assert {"copy", "commit", "barrier"} <= set(r["save_phases"]) and "reads" in r["load_phases"]
    tiny = rows["tiny"]
    assert tiny["bad"] == [] and tiny["tensors"] == 8 and "x_load_reshard" not in tiny


def test_the_check_tells_a_wrong_or_missing_tensor_bit_for_bit():
    expected = {"a": torch.tensor([1.0, float("nan")]), "b": torch.tensor([0.0]), "c": torch.tensor(3)}
    same = {"a": torch.tensor([1.0, float("nan")]), "b": torch.tensor([0.0]), "c": torch.tensor(3)}
    assert check(same, expected) == []
    wrong = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([-0.0]), "x": torch.tensor(1)}
    assert check(wrong, expected) == ["a", "b", "c", "x"]


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_sigterm_removes_the_scratch_in_dev_shm_and_stops_the_store():
    """A benchmark stopped with SIGTERM (a CI timeout, `kill`) unwinds as after Ctrl-C: its DCP scratch in
    /dev/shm and its store were left behind by SIGTERM's default action."""
    before = set(Path("/dev/shm").glob("tenplex-small-*"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = [sys.executable, "benchmarks/bench_small.py", "--quick", "--out", os.devnull]
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
    try:
        deadline = time.time() + 60  # until its ranks run: the store is up and in use
        while not _children(p.pid, "small_worker") and time.time() < deadline:
            time.sleep(0.1)
        stores = _children(p.pid, "tenplex.store")
        scratch = set(Path("/dev/shm").glob("tenplex-small-*")) - before
        assert stores and len(scratch) == 1, (stores, scratch)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode != 0 and "Terminated" in err, err[-2000:]
    assert not any(d.exists() for d in scratch)
    assert not any(Path(f"/proc/{pid}").exists() for pid in stores)


def _children(pid: int, needle: str) -> list[int]:
    """The processes below `pid` whose command line holds `needle`."""
    out = []
    for c in descendants(pid):
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{c}/cmdline").read_text():
                out.append(c)
    return out
