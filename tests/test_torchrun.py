"""The training script under torchrun with c10d rendezvous: a worker group joins, then leaves, mid-run.

Two torchrun agents are two emulated hosts, each with its own tensor store. Agent A trains alone (world 2),
agent B joins (torchrun restarts every worker: world 4), B is terminated (A's workers fail on the lost
peers and torchrun restarts them: world 2 again). Each start must load the newest snapshot from the stores
into the layout chosen for its world and continue to the last step.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from launch import SRC
from tenplex.runtime.records import read_records
from tenplex.store import start_store

pytestmark = pytest.mark.dist

STEPS = 40
JOB = "torchrun-elastic"
# para-config: the join and the leave change tp and pp, not only dp
TABLE = {"2": {"dp": 1, "tp": 1, "pp": 2}, "4": {"dp": 2, "tp": 2, "pp": 1}}
RDZV_CONF = "join_timeout=90,last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=3"


def _rendezvous_store():
    """The job's c10d rendezvous store, hosted here on a port the kernel picks as it binds (the agents join
    with is_host=false). A port picked free first and bound by the first agent seconds later could meanwhile
    be taken as another connection's source port: that agent then waited 2 x 60 s on a store that never
    came. Skips where nothing can listen."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
        )
    except (RuntimeError, OSError) as e:  # DistNetworkError and friends: nothing can listen here
        pytest.skip(f"cannot host a c10d TCPStore on 127.0.0.1: {e}")


def _descendants(pid: int) -> list[int]:
    """Processes below `pid` (Linux /proc): torchrun starts its workers in sessions of their own."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the agent (it stops its workers), then SIGKILL whatever of it is left."""
    if proc.poll() is not None:
        return
    below = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(40)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _attempts(out: Path) -> list[dict]:
    """The worker records split into starts: each begins with 'fresh' or 'loaded' (written by rank 0)."""
    records, _ = read_records(out / "worker.jsonl")
    starts: list[dict] = []
    for r in records:
        if r["kind"] in ("fresh", "loaded"):
            starts.append({"start": r, "ready": None, "steps": [], "done": None})
        elif starts and r["kind"] == "ready":
            starts[-1]["ready"] = r
        elif starts and r["kind"] == "step":
            starts[-1]["steps"].append(r)
        elif starts and r["kind"] == "done":
            starts[-1]["done"] = r
    return starts


def _wait(what: str, cond: Callable[[], bool], agents: dict[str, subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [name for name, p in agents.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"agent exited early {dead}" if dead else "timeout"
            raise AssertionError(f"waiting for {what}: {why}")
        time.sleep(0.3)


def test_torchrun_join_and_leave(tmp_path: Path) -> None:
    rdzv = _rendezvous_store()
    out = tmp_path / "out"
    (tmp_path / "table.json").write_text(json.dumps(TABLE))
    stores = [start_store(log=str(tmp_path / f"store{i}.log"), memory_limit="1GiB") for i in range(2)]
    agents: dict[str, subprocess.Popen] = {}
    port = rdzv.port

    def agent(name: str, store: str) -> subprocess.Popen:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
            TENPLEX_STORE=store,
            TENPLEX_SOURCES=",".join(s.url for s in stores),
            TENPLEX_EMULATED_HOSTS="1",
            # torch's shared rendezvous TCPStore does not let a node join a running job (it waits for a
            # MASTER_ADDR key that no one writes in the new round); without sharing, scale-up works
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={JOB}",
            f"--rdzv-conf={RDZV_CONF},is_host=false", "--max-restarts=5", "--monitor-interval=0.5",
            "-m", "tenplex.runtime.elastic", "--model", "tiny", "--steps", str(STEPS), "--global-batch", "12",
            "--job", JOB, "--snapshot-every", "2", "--min-step-seconds", "0.4", "--out", str(out),
            "--table", str(tmp_path / "table.json"),
        ]  # fmt: skip
        log = open(tmp_path / f"agent-{name}.log", "w")  # noqa: SIM115 - owned by the child
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        agents[name] = p
        return p

    def world_steps(world: int) -> int:
        return sum(len(a["steps"]) for a in _attempts(out) if a["ready"] and a["ready"]["world"] == world)

    try:
        a = agent("A", stores[0].url)
        _wait("A to train alone", lambda: world_steps(2) >= 4, agents, 120)
        b = agent("B", stores[1].url)
        _wait("the 4-worker world to train", lambda: world_steps(4) >= 3, agents, 120)
        _stop(b)
        del agents["B"]
        a.wait(150)
        assert a.returncode == 0, (tmp_path / "agent-A.log").read_text()[-4000:]
    finally:
        for p in agents.values():
            _stop(p)
        for s in stores:
            s.stop()

    starts = _attempts(out)
    worlds = [s["ready"]["world"] for s in starts if s["ready"]]
    layouts = [s["ready"]["layout"] for s in starts if s["ready"]]
    assert 4 in worlds and worlds[0] == 2 and worlds[-1] == 2, worlds
    assert "dp2-tp2-pp1" in layouts and "dp1-tp1-pp2" in layouts, layouts
    assert starts[0]["start"]["kind"] == "fresh"
    assert all(s["start"]["kind"] == "loaded" for s in starts[1:]), [s["start"]["kind"] for s in starts]
    # each start continues from a snapshot, at most --snapshot-every steps behind what was trained
    trained = 0
    for s in starts:
        assert s["start"]["step"] >= trained - 2 if trained else s["start"]["step"] == 0
        if s["steps"]:
            assert s["steps"][0]["step"] == s["start"]["step"] + 1
            trained = s["steps"][-1]["step"]
    last = starts[-1]
    assert last["done"] and last["done"]["step"] == STEPS
    losses = [r["loss"] for s in starts for r in s["steps"]]
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0]
    # a replayed step gives the same loss in any layout (same state, same global batch)
    first: dict[int, float] = {}
    for s in starts:
        for r in s["steps"]:
            ref = first.setdefault(r["step"], r["loss"])
            assert abs(r["loss"] - ref) < 1e-2, (r["step"], r["layout"], r["loss"], ref)
