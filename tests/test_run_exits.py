"""Every way `tenplex run` can end early leaves nothing running, or says in one line that it kept the
stores for a resume, and then `tenplex stop RUN_DIR` removes them: no process of the run's session, no
store of its logs, no store's shared memory in /dev/shm. A tiny script (one small tensor, paced steps)
keeps each run to seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenplex.store.process import logged_stores
from tenplex.store.shm import shm_root

SRC = str(Path(__file__).resolve().parent.parent / "src")
pytestmark = pytest.mark.dist

# UNTIL EVERY NUMEL [--crash]: its own step count and snapshot interval, the size of its state; 50 ms steps
SCRIPT = """
import sys, time
import torch
import tenplex

until, every, numel, crash = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "--crash" in sys.argv
job = tenplex.ElasticJob("exits", until=until, snapshot_every=every)
if crash:
    raise ValueError("bad batch")
state = {"w": torch.zeros(numel)}
step = job.resume(state)
while job.running(step):
    time.sleep(0.05)
    step += 1
    state["w"] += 1
    job.step_done(step, state, loss=float(step))
job.finish(state, step)
"""


def start(
    tmp_path: Path, name: str, script_args: str, *extra: str, schedule: list | None = None
) -> tuple[subprocess.Popen, Path]:
    """`tenplex run` of the script in a session of its own (what a terminal's Ctrl-C reaches)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(schedule or [{"step": 0, "devices": 2}]))
    run_dir = tmp_path / name
    args = ["run", "--schedule", str(path), "--script", f"{script} {script_args}", "--run-dir", str(run_dir),
            "--job", name, "--quiet", *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=SRC)
    p = subprocess.Popen([sys.executable, "-m", "tenplex.cli.main", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True,
                         preexec_fn=_interruptible)  # fmt: skip
    return p, run_dir


def _interruptible() -> None:
    """Ctrl-C's default action in the run, as in a terminal: a suite started in the background by a shell
    without job control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def tenplex(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-m", "tenplex.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def wait_for(run_dir: Path, kind: str, timeout: float = 120) -> None:
    """Until the timeline holds a worker record of `kind` (e.g. "snapshot": a save is under way)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = run_dir / "timeline.jsonl"
        if path.exists() and f'"event": "{kind}"' in path.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"no {kind} record in {timeout} s")


def session(sid: int) -> list[int]:
    """The processes of session `sid` (the run and every process it forked), zombies aside."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def stores(run_dir: Path) -> list[tuple[int, Path]]:
    """Every store the run started (its logs), with its shared-memory directory."""
    found = [(url, pid) for log in run_dir.glob("store-*.log") for url, pid in logged_stores(str(log))]
    return [(pid, Path(shm_root()) / f"tenplex-{url.rsplit(':', 1)[1]}-{pid}") for url, pid in found]


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def left(run_dir: Path, sid: int) -> list[str]:
    """What the run left: its session's processes, its stores, their shared memory (after a grace)."""
    deadline = time.time() + 15
    while True:
        what = [f"process {p}" for p in session(sid)]
        what += [f"store {pid}" for pid, _ in stores(run_dir) if running(pid)]
        what += [f"shm {d.name}" for _, d in stores(run_dir) if d.exists()]
        if not what or time.time() > deadline:
            return what
        time.sleep(0.1)


def check_kept_then_stop(out: str, run_dir: Path, sid: int) -> None:
    """The one line said the stores were kept and how to stop them; they run (and only they), until
    `tenplex stop` removes them; a second stop has nothing to do."""
    kept = [line for line in out.splitlines() if "kept" in line]
    assert len(kept) == 1 and "run the same command again" in kept[0], out
    assert f"tenplex stop {run_dir}" in kept[0], out
    deadline = time.time() + 15
    while session(sid) and time.time() < deadline:  # the ranks end with the controller
        time.sleep(0.1)
    assert session(sid) == [] and any(running(p) for p, _ in stores(run_dir))
    status = tenplex("status", str(run_dir), "--json")
    s = json.loads(status.stdout)
    assert s["controller"] != "running" and s["committed_step"] and all(x["alive"] for x in s["stores"]), s
    stop = tenplex("stop", str(run_dir))
    assert stop.returncode == 0 and stop.stdout.startswith("stopped "), stop.stdout + stop.stderr
    assert left(run_dir, sid) == []
    again = tenplex("stop", str(run_dir))
    assert again.returncode == 0 and again.stdout.startswith("nothing to stop"), again.stdout


def test_an_error_before_the_start_starts_nothing(tmp_path):
    """A forced layout the devices cannot take: one line, exit 2, no process, not even a run directory."""
    p, run_dir = start(tmp_path, "bad", "5 2 8", schedule=[{"step": 0, "devices": 4, "layout": {"tp": 3}}])
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and out.count("\n") == 1 and "needs 3 devices, the job has 4" in out, out
    assert not run_dir.exists() and left(run_dir, p.pid) == []


def test_an_error_mid_run_with_nothing_committed_stops_everything(tmp_path):
    """Stores too small for the final save: the run ends (exit 1) and, with no snapshot to resume from,
    stops its stores and says so."""
    p, run_dir = start(tmp_path, "full", "4 0 1048576", "--store-memory", "1MiB")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1 and "does not fit in the stores" in out, out
    assert "stopped its ranks and stores (no snapshot to resume from)" in out, out
    assert stores(run_dir) and left(run_dir, p.pid) == []


def test_an_exception_mid_run_keeps_the_committed_stores_and_says_how_to_resume_or_stop(tmp_path):
    """A bug's exception (here: a file where the second phase's directory goes) after snapshots committed:
    the traceback, and the one line that the stores are kept."""
    schedule = [{"step": 0, "devices": 2}, {"step": 6, "devices": 1}]
    script_run = tmp_path / "boom"
    script_run.mkdir()
    (script_run / "phase1").write_text("in the way")
    p, run_dir = start(tmp_path, "boom", "12 2 8", "--no-ahead", schedule=schedule)  # phase1 made at step 6
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1 and "FileExistsError" in out, out
    check_kept_then_stop(out, run_dir, p.pid)


def test_ctrl_c_keeps_the_stores_for_a_resume_and_says_so(tmp_path):
    """SIGINT to the run's whole process group, as a terminal sends it, once a snapshot committed."""
    p, run_dir = start(tmp_path, "ctrlc", "100000 2 8")
    wait_for(run_dir, "snapshot")
    time.sleep(0.5)  # that snapshot commits
    os.killpg(p.pid, signal.SIGINT)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130 and "tenplex run: interrupted; kept" in out, out
    check_kept_then_stop(out, run_dir, p.pid)


def test_sigterm_with_nothing_committed_stops_every_process_and_store(tmp_path):
    """SIGTERM to the controller alone, before any snapshot (none is taken until the phase ends): its ranks
    end with it, its stores are stopped, their shared memory removed."""
    p, run_dir = start(tmp_path, "term", "100000 0 8")
    wait_for(run_dir, "step")
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 143 and "terminated (SIGTERM); stopped its ranks and stores" in out, out
    assert stores(run_dir) and left(run_dir, p.pid) == []


def test_ranks_that_keep_crashing_end_the_run_and_leave_nothing(tmp_path):
    """A script that raises before its first step: three crashed phases, exit 1, the rank log named,
    everything stopped (nothing was committed)."""
    p, run_dir = start(tmp_path, "crash", "5 2 8 --crash")
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 1 and "ranks crashed in 3 phases in a row" in out, out
    assert (
        "stopped its ranks and stores" in out
        and "bad batch" in (run_dir / "phase0" / "rank0.log").read_text()
    )
    assert left(run_dir, p.pid) == []


def test_status_and_stop_need_a_run_directory(tmp_path):
    for command in ("status", "stop"):
        r = tenplex(command, str(tmp_path))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no cluster.json" in r.stderr, r.stderr
