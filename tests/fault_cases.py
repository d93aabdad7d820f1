"""Helpers of tests/test_faults.py: run `tenplex run` jobs, and check what a fault may never do to them.

After every fault: the job finished every step, each sample exactly once (the ledger), its losses within
the static run's fp32 drift (no foreign byte loaded), the recovery from the newest snapshot that could have
been committed, and nothing of the run left behind: no store, no rank, no `/dev/shm/tenplex-*` directory of
its stores, no network namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch import SRC
from tenplex.runtime.demo import LOSS_TOLERANCE
from tenplex.runtime.hosts import health
from tenplex.store.process import logged_stores
from tenplex.store.shm import shm_root

STEPS = 12
COMMON = ["--steps", str(STEPS), "--global-batch", "12", "--snapshot-every", "2", "--quiet"]


def cli(*args: str) -> subprocess.Popen:
    """`tenplex ARGS` as a process of its own (output captured, merged)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "tenplex.cli.main", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def run_job(run_dir: Path, schedule: list[dict], *extra: str) -> list[str]:
    """The arguments of `tenplex run` for `schedule` in `run_dir` (the schedule written beside it)."""
    sched = run_dir.with_suffix(".json")
    sched.parent.mkdir(parents=True, exist_ok=True)
    sched.write_text(json.dumps(schedule))
    return [
        "run",
        "--schedule",
        str(sched),
        "--run-dir",
        str(run_dir),
        "--job",
        run_dir.name,
        *COMMON,
        *extra,
    ]


def finish(p: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]


def check_outcome(run_dir: Path, static: dict) -> dict:
    """The run's summary, after checking every step ran once, each sample once, and the losses."""
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == STEPS and s["ledger"]["ok"], s["ledger"]
    assert s["ledger"]["mismatched_steps"] == [], s["ledger"]
    assert sorted(s["losses"], key=int) == sorted(static["losses"], key=int), sorted(s["losses"])
    diff = max(abs(s["losses"][k] - static["losses"][k]) for k in static["losses"])
    assert diff <= LOSS_TOLERANCE, f"losses differ from the static run by {diff:.3g} (a foreign byte?)"
    return s


def check_recovered_from_newest(recs: list[dict], every: int) -> list[dict]:
    """Each recovery resumed from a snapshot taken before its failure, at most one snapshot interval
    older than the newest one started (the one in flight may not have committed): none committed lost."""
    recovers = [r for r in recs if r["kind"] == "recover"]
    assert recovers, [r["kind"] for r in recs]
    for rec in recovers:
        fail = next(r for r in reversed(recs[: recs.index(rec)]) if r["kind"] in ("fail", "crash"))
        before = recs[: recs.index(fail)]
        started = [r["step"] for r in before if r.get("event") in ("snapshot", "saved", "loaded", "fresh")]
        newest = max([0, *(s for s in started if s <= fail["step"])])
        assert newest - every <= rec["step"] <= fail["step"], (rec, fail, started)
    return recovers


def check_nothing_left(run_dir: Path, timeout: float = 15) -> None:
    """No store the run started still answers, no process names the run's directory, and no shared-memory
    directory of its stores is left."""
    check_no_process_left(run_dir, timeout)
    left = shm_left(run_dir)
    assert not left, f"shared memory of the run's stores left: {left}"


def check_no_process_left(run_dir: Path, timeout: float = 15) -> None:
    stores = stores_of(run_dir)
    deadline = time.time() + timeout
    while time.time() < deadline and (any(health(u) for u, _ in stores) or _processes_of(run_dir)):
        time.sleep(0.2)
    assert not [u for u, _ in stores if health(u)], "stores of the run still answer"
    assert not _processes_of(run_dir), "processes of the run left behind"


def shm_left(run_dir: Path, but: str = "") -> list[str]:
    """The `tenplex-PORT-PID` shared-memory directories of the run's stores still there (but those of the
    stores logged in the file named `but`)."""
    pids = {str(pid) for _, pid in stores_of(run_dir, but) if pid}
    return sorted(
        n for n in os.listdir(shm_root()) if n.startswith("tenplex-") and n.rsplit("-", 1)[-1] in pids
    )


def stores_of(run_dir: Path, but: str = "") -> list[tuple[str, int | None]]:
    return [a for log in run_dir.glob("store-*.log") if log.name != but for a in logged_stores(str(log))]


def _processes_of(run_dir: Path) -> list[int]:
    """PIDs of this user's processes whose command line or environment names `run_dir`."""
    mark = str(run_dir.resolve()).encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                data = Path(f"/proc/{pid}/{part}").read_bytes()
            except OSError:
                continue
            if mark in data:
                found.append(int(pid))
                break
    return found
