"""A run directory seen from outside its controller: what the run is doing (`tenplex status RUN_DIR`) and
stopping what it left running (`tenplex stop RUN_DIR`, and a controller that ends early with nothing to
resume from). Torch-free: it reads `cluster.json`, the timeline and the stores' logs, and asks the stores.

Every process is signalled only while it is still the one recorded (its PID and start time, or a store
answering at its URL as that PID), never a process that took a recorded PID since.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from ..ptc import TenplexError
from ..store import StoreClient, StoreError
from ..store.process import logged_stores
from ..store.shm import shm_root
from .hosts import is_store, started_at
from .records import Kind, read_records

STOP_WAIT_S = 10.0  # a store told to stop gets this long to remove its memory before it is killed
CONTROLLER_WAIT_S = 60.0  # a running controller told to stop gets this long to end


class RunDirError(TenplexError):
    """Not the directory of a `tenplex run`."""


def cluster(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "cluster.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise RunDirError(
            f"{str(run_dir)!r} is not a run directory of `tenplex run` (no cluster.json)"
        ) from None
    except ValueError as e:
        raise RunDirError(f"{path} is not readable: {e}") from None


def live_stores(run_dir: Path) -> dict[str, dict]:
    """The run's stores still running, by host: those in cluster.json and any the stores' logs name (a
    controller stopped while a store started never recorded it)."""
    out = {h: s for h, s in cluster(run_dir).get("stores", {}).items() if is_store(s)}
    urls = {s["url"] for s in out.values()}
    for log in sorted(run_dir.glob("store-*.log")):
        host = log.stem[len("store-") :]
        for url, pid in logged_stores(str(log)):
            if url not in urls and pid is not None and is_store({"url": url, "pid": pid}):
                out.setdefault(host, {"url": url, "pid": pid, "since": started_at(pid)})
    return out


def controller_alive(run_dir: Path) -> dict | None:
    """The run's controller, if it is still running (another terminal's `tenplex run`)."""
    c = cluster(run_dir).get("controller")
    if not c or c["pid"] == os.getpid() or started_at(c["pid"]) != c.get("since"):
        return None
    return c


def stop_stores(stores: dict[str, dict]) -> list[str]:
    """SIGTERM each store and wait until it is gone (it removes its shared memory); one that does not end
    is killed and its memory removed here. The hosts stopped."""
    for s in stores.values():
        _signal(s["pid"], signal.SIGTERM)
    deadline = time.time() + STOP_WAIT_S
    while time.time() < deadline and any(is_store(s) for s in stores.values()):
        time.sleep(0.05)
    for s in stores.values():
        if is_store(s):
            _signal(s["pid"], signal.SIGKILL)
            port = s["url"].rsplit(":", 1)[-1]
            shutil.rmtree(Path(shm_root()) / f"tenplex-{port}-{s['pid']}", ignore_errors=True)
    return sorted(stores)


def stop(run_dir: Path) -> str:
    """Stop the run's controller (if one still runs), then its stores; one line saying what was stopped."""
    what = []
    ctl = controller_alive(run_dir)
    if ctl is not None:
        _signal(ctl["pid"], signal.SIGTERM)
        deadline = time.time() + CONTROLLER_WAIT_S
        while started_at(ctl["pid"]) == ctl["since"] and time.time() < deadline:
            time.sleep(0.1)
        what.append(f"its controller (pid {ctl['pid']}, and with it the ranks)")
    stores = live_stores(run_dir)
    if stores:
        stop_stores(stores)
        _forget_stores(run_dir)
        what.append(
            f"{len(stores)} stores ("
            + ", ".join(f"{h} pid {s['pid']}" for h, s in sorted(stores.items()))
            + ")"
        )
    if not what:
        return f"nothing to stop: no controller or store of {run_dir} is running"
    return f"stopped {' and '.join(what)} of {run_dir}"


def _forget_stores(run_dir: Path) -> None:
    """cluster.json without its stores, written whole (a rerun starts new ones)."""
    data = cluster(run_dir)
    data["stores"] = {}
    tmp = run_dir / "cluster.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.rename(run_dir / "cluster.json")


def committed_step(job: str, stores: dict[str, dict]) -> int | None:
    """The newest step of `job` committed on any of `stores`; None when none holds one."""
    steps = [v for h, s in stores.items() for v in _store(h, s, job, True).get("committed", [])]
    return max(steps, default=None)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def status(run_dir: Path) -> dict[str, Any]:
    """The job, its layout and step, the controller, and each store with its memory and the job's
    committed steps (a store that does not answer: alive False)."""
    data = cluster(run_dir)
    recs, _ = read_records(run_dir / "timeline.jsonl")
    start = next((r for r in recs if r["kind"] == Kind.START), {})
    launch = next((r for r in reversed(recs) if r["kind"] == Kind.LAUNCH), {})
    steps = (r["step"] for r in reversed(recs) if r["kind"] == Kind.WORKER and r["event"] == Kind.STEP)
    step = next(steps, 0)
    job = start.get("job")
    alive = live_stores(run_dir)
    stores = [_store(h, s, job, h in alive) for h, s in sorted({**data.get("stores", {}), **alive}.items())]
    committed = max((v for s in stores for v in s.get("committed", [])), default=None)
    ended = next((r["kind"] for r in reversed(recs) if r["kind"] in (Kind.FINISH, Kind.GIVE_UP)), None)
    return {
        "run_dir": str(run_dir),
        "job": job,
        "steps": start.get("steps"),
        "layout": launch.get("layout"),
        "devices": data.get("allocation", []),
        "step": step,
        "committed_step": committed,
        "controller": "running" if controller_alive(run_dir) else (ended or "not running"),
        "stores": stores,
    }


def _store(host: str, s: dict, job: str | None, alive: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"host": host, "url": s["url"], "pid": s["pid"], "alive": alive}
    if not alive:
        return out
    try:
        c = StoreClient(s["url"], local=False, retries=0, timeout=2)
        stats = c.stats()
        out.update(memory_used=stats["memory_used"], memory_limit=stats["memory_limit"])
        out["committed"] = c.versions(job) if job else []
    except StoreError as e:
        out.update(alive=False, error=str(e))
    return out
