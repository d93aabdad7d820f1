"""The benchmark tables in the docs are generated from results/*.json (scripts/tables.py), never typed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tables", ROOT / "scripts" / "tables.py")
assert _spec and _spec.loader
tables = importlib.util.module_from_spec(_spec)
sys.modules["tables"] = tables  # dataclasses look their module up
_spec.loader.exec_module(tables)


def test_the_docs_tables_match_the_results():
    done = subprocess.run(
        [sys.executable, "scripts/tables.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def _root(tmp_path: Path, names=None) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "results").mkdir()
    markers = "".join(
        f"<!-- table:{n} -->\nold typed figure 42\n<!-- /table:{n} -->\n\n" for n in names or tables.TABLES
    )
    (tmp_path / "README.md").write_text("# x\n\nprose stays\n\n")
    (tmp_path / "docs" / "benchmarks.md").write_text("# b\n\n" + markers + "the end\n")
    return tmp_path


def _planner_results(root: Path, plan_s: float) -> None:
    row = {
        "model": "gpt3-175b", "devices": "4096->8192", "tensors": 4624, "new_shards": 2369536,
        "plan_s": plan_s, "all_pairs_s": None, "speedup_vs_all_pairs": None, "assign_s": 1.2,
        "cross_host_GB": 130148.47, "matched_cross_host_GB": 67285.18, "matched_vs_numbering": 0.517,
    }  # fmt: skip
    doc = {
        "benchmark": "bench_planner",
        "when": "2026-01-01T00:00:00Z",
        "machine": {"cpus": 2, "load": 3.3},
        "rows": [row],
    }
    (root / "results" / "bench_planner.json").write_text(json.dumps(doc))


def test_a_missing_result_names_its_command_and_a_present_one_is_rendered(tmp_path):
    root = _root(tmp_path)
    _planner_results(root, 0.29)
    assert tables.main(["--root", str(root)]) == 0
    text = (root / "docs" / "benchmarks.md").read_text()
    assert "old typed figure" not in text and text.endswith("the end\n")
    assert "→ `results/bench_planner.json` (2026-01-01T00:00:00Z, 2 CPUs, load average 3.3):" in text
    assert "| gpt3-175b | 4096 → 8192 | 4,624 | 2,369,536 | 0.29 | – | – |" in text
    assert "| gpt3-175b | 4096 → 8192 | 1.2 | 130 TB | 67.3 TB | 0.52 |" in text
    assert (
        "Not measured yet: run `python benchmarks/bench_store.py` (writes `results/bench_store.json`)."
        in text
    )
    assert "Not measured yet: run `python benchmarks/bench_planner.py`" not in text
    assert (root / "README.md").read_text() == "# x\n\nprose stays\n\n"
    assert tables.main(["--root", str(root), "--check"]) == 0  # idempotent


def test_check_fails_when_a_result_changed_and_changes_nothing(tmp_path):
    root = _root(tmp_path)
    _planner_results(root, 0.29)
    tables.main(["--root", str(root)])
    before = (root / "docs" / "benchmarks.md").read_text()
    _planner_results(root, 0.31)
    assert tables.main(["--root", str(root), "--check"]) == 1
    assert (root / "docs" / "benchmarks.md").read_text() == before
    assert tables.main(["--root", str(root)]) == 0
    assert "| 0.31 |" in (root / "docs" / "benchmarks.md").read_text()


def test_unknown_repeated_or_unplaced_tables_are_errors(tmp_path):
    root = _root(tmp_path, [*tables.TABLES, "plannr"])
    with pytest.raises(SystemExit, match="unknown table 'plannr'"):
        tables.main(["--root", str(root)])
    (root / "docs" / "benchmarks.md").write_text("<!-- table:store -->\n<!-- /table:store -->\n")
    with pytest.raises(SystemExit, match="placed nowhere"):
        tables.main(["--root", str(root)])
    (root / "README.md").write_text("<!-- table:store -->\n<!-- /table:store -->\n")
    with pytest.raises(SystemExit, match="in both"):
        tables.main(["--root", str(root)])


def test_figures_are_printed_readably():
    assert tables.num(None) == "–" and tables.num(3186688) == "3,186,688" and tables.num(0.2617) == "0.262"
    assert tables.num(12345.6) == "12,346" and tables.num(True) == "yes"
    row = {"case": "net one-element box, one request each", "ms per request": 0.33, "raw socket ms": 0.02}
    assert tables.store_result(row) == "ms per request 0.33; raw socket ms 0.02"
    assert tables.size("x")({"x": 0.0132}) == "13.2 MB" and tables.size("x")({"x": 7368.4}) == "7.37 TB"


def test_a_demo_summary_becomes_the_readme_table_without_local_paths(tmp_path):
    root = _root(tmp_path)
    reconfig = {
        "kind": "reconfig", "from": "dp2-tp1-pp1", "to": "dp1-tp2-pp2", "step": 10, "failure": False,
        "redeploy": False, "downtime": 3.04, "load_seconds": 0.291,
        "bytes": {"cross_host": 803068.0, "kept": 454776.0, "relayed": 11260.0, "same_host": 454776.0},
        "plan": {"cross_host_lower_bound": 803068},
    }  # fmt: skip
    summary = {
        "run_dir": "/somewhere/runs/demo/elastic", "steps": 60, "losses": {"1": 5.5},
        "reconfigurations": [reconfig, {**reconfig, "from": "dp2-tp2-pp1", "to": "dp3-tp1-pp1",
                                        "failure": True}],
        "recoveries": [{"step": 40, "lost_steps": 3}],
        "ledger": {"ok": True, "samples": 720},
        "static": {"steps": 60, "max_loss_diff": 1.7e-6, "tolerance": 5e-6, "match": True,
                   "max_param_diff": 1.2e-4, "param_tolerance": 5e-4},
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert tables.main(["--root", str(root), "--take-demo", str(tmp_path / "summary.json")]) == 0
    kept = json.loads((root / "results" / "demo.json").read_text())
    assert "run_dir" not in kept and "losses" not in kept and kept["benchmark"] == "demo"
    text = (root / "docs" / "benchmarks.md").read_text()
    assert (
        "| dp2-tp1-pp1 → dp1-tp2-pp2 | scale out 2 → 4 | 10 | 3.0 s | 0.29 s | 1.21 MiB | 784 KiB | 784 KiB |"
        in text
    )
    assert "| dp2-tp2-pp1 → dp3-tp1-pp1 | failure | 10 |" in text
    assert "snapshot at step 40 (3 steps replayed)" in text and "The loss curve matches" in text
    assert "every one of the 720 samples" in text


def test_the_command_a_benchmark_recorded_is_the_one_shown(tmp_path):
    root = _root(tmp_path)
    _planner_results(root, 0.29)
    path = root / "results" / "bench_planner.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "command": "python benchmarks/bench_planner.py --max-devices 512"}))
    tables.main(["--root", str(root)])
    text = (root / "docs" / "benchmarks.md").read_text()
    assert "`python benchmarks/bench_planner.py --max-devices 512` → `results/bench_planner.json`" in text
