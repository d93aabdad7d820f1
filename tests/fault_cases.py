"""Helpers of tests/test_faults.py: run `tenplex run` jobs, and check what a fault may never do to them.

After every fault: the job finished every step, each sample exactly once (the ledger), its losses within
the static run's fp32 drift (no foreign byte loaded), the recovery from the newest snapshot that could have
been committed, and nothing of the run left behind: no store, no rank, no `/dev/shm/tenplex-*` directory of
its stores, no network namespace.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from launch import SRC
from tenplex.runtime.demo import LOSS_TOLERANCE
from tenplex.runtime.hosts import health
from tenplex.store import NotFoundError, StoreClient, StoreError
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


def kill_controller_at(p: subprocess.Popen, run_dir: Path, reached: Callable[[str], bool]) -> None:
    """SIGKILL the controller `p` once its timeline's text is `reached` (it must still run then)."""
    timeline = run_dir / "timeline.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if timeline.exists() and reached(timeline.read_text()):
            break
        time.sleep(0.05)
    assert p.poll() is None, "the job ended before the fault"
    p.send_signal(signal.SIGKILL)
    p.communicate()


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
    """Waits up to `timeout` for the run's stores to have exited, not merely stopped answering: a stopping
    store closes its sockets before it removes its shared memory."""
    stores = stores_of(run_dir)
    pids = [pid for _, pid in stores if pid]
    deadline = time.time() + timeout

    def left() -> bool:
        return any(health(u) for u, _ in stores) or any(map(_alive, pids)) or bool(_processes_of(run_dir))

    while time.time() < deadline and left():
        time.sleep(0.2)
    assert not [u for u, _ in stores if health(u)], "stores of the run still answer"
    assert not [p for p in pids if _alive(p)], "stores of the run still running"
    assert not _processes_of(run_dir), "processes of the run left behind"


def _alive(pid: int) -> bool:
    """Whether the store `pid` runs: a zombie has exited, and a PID taken since by another process (PIDs
    wrap at 32768 here) is no store."""
    try:
        running = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        return running and b"tenplex.store" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def stop_stores(root: Path) -> list[int]:
    """SIGTERM the stores of every run under `root` that still answer as the process they logged (a failed
    case leaves them, as a failed `tenplex run` does for a rerun); their PIDs."""
    stopped = []
    for log in root.rglob("store-*.log"):
        for url, pid in logged_stores(str(log)):
            answer = health(url)
            if pid and answer is not None and answer.get("pid") == pid:
                os.kill(pid, signal.SIGTERM)
                stopped.append(pid)
    return stopped


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


def flip_byte(url: str, job: str, step: int, r: random.Random) -> str:
    """Flip one byte in one blob file of committed version `step` in the store at `url` (on this host): the
    high byte of a float of the largest model tensor's blob, so a load that took it would be far off the
    static run. The blob is held (a `locate` lease) while its file is changed, so the file cannot be
    another blob's by then. What was flipped, in words."""
    c = StoreClient(url, retries=0, timeout=5)
    try:
        blobs = [b for b in c.blobs(job, step) if b["dtype"] == "float32" and "model" in b["name"]]
        name = max(blobs, key=lambda b: (b["nbytes"], b["name"]))["name"]
        found, held = c.transport.lease("POST", f"/v1/jobs/{job}/versions/{step}/locate", {"names": [name]})
        try:
            info = found["blobs"][0]
            at = 4 * r.randrange(info["nbytes"] // 4) + 3
            at += info["offset"]  # the blob's place in its file (a pack holds many blobs)
            fd = os.open(info["path"], os.O_RDWR)  # the store's own directory (a huge-page store's too)
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
            finally:
                os.close(fd)
        finally:
            if held is not None:
                held.close()  # ends the lease
    finally:
        c.close()
    return f"{name} byte {at}"


class Corrupter(threading.Thread):
    """Flips a byte (`flip_byte`) in every version of `job` from step `first` on as it commits in the store
    at `url`, until the timeline shows the recovery (the failed phase's ranks are gone by then: none of
    its versions commits later), then looks once more and stops. `flipped`: step -> what was flipped;
    `when`: step -> the time its flip was done; `seen`: the committed steps at the end."""

    def __init__(self, url: str, job: str, first: int, run_dir: Path, r: random.Random) -> None:
        super().__init__(daemon=True)
        self.url, self.job, self.first, self.run_dir, self.r = url, job, first, run_dir, r
        self.flipped: dict[int, str] = {}
        self.when: dict[int, float] = {}
        self.seen: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        timeline = self.run_dir / "timeline.jsonl"
        store = StoreClient(self.url, retries=0, timeout=5)
        deadline = time.time() + 240
        try:
            while time.time() < deadline:
                last = timeline.exists() and '"kind": "recover"' in timeline.read_text()
                self.seen = store.versions(self.job)
                for s in self.seen:
                    if s >= self.first and s not in self.flipped:
                        try:
                            self.flipped[s] = flip_byte(self.url, self.job, s, self.r)
                            self.when[s] = time.time()
                        except NotFoundError:  # deleted since (the job keeps its newest three)
                            self.seen.remove(s)
                if last:
                    return
                time.sleep(0.02)
        except (StoreError, OSError) as e:
            self.error = e
        finally:
            store.close()


def netem_missing() -> str | None:
    """Why a lossy link cannot be emulated here (the kernel's netem qdisc, tried once in a namespace of
    its own), or None."""
    probe = f"tpx-netem-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        tc = ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "loss", "1%"]
        done = subprocess.run(tc, capture_output=True, text=True)
        return None if done.returncode == 0 else f"tc netem is not available: {done.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
