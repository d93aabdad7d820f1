"""Running `tenplex agent`s as emulated hosts on this machine (tests and the agent benchmark).

Each agent is a host: its own store on its own port (`TENPLEX_EMULATED_HOSTS=1`: the other stores are
reached over sockets), its own run directory, one rendezvous endpoint for all. A host is lost as a real
one would be: the agent and its store SIGKILLed at once (its workers die with the agent).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from launch import SRC
from tenplex.runtime.records import read_records
from tenplex.util import free_port

TABLE = {"2": {"dp": 1, "tp": 1, "pp": 2}, "4": {"dp": 2, "tp": 2, "pp": 1}}  # a change moves tp and pp


def c10d_unavailable() -> str | None:
    """Why a c10d rendezvous cannot work here (it hosts a TCPStore on the endpoint), or None."""
    try:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
        )
        del store
    except (RuntimeError, OSError) as e:  # DistNetworkError and friends: nothing can listen here
        return f"cannot host a c10d TCPStore on 127.0.0.1: {e}"
    return None


def environ(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
        TENPLEX_EMULATED_HOSTS="1",
        TENPLEX_STATE_DIR=str(tmp / "state"),
    )
    env.pop("TENPLEX_STORE", None)
    env.pop("TENPLEX_SOURCES", None)
    return env


class Cluster:
    """Agents of one job on this machine, each an emulated host with its own store port."""

    def __init__(self, tmp: Path, job: str, target: list[str], nodes: str = "1:2", nproc: int = 2) -> None:
        self.tmp, self.job, self.target, self.nodes, self.nproc = tmp, job, target, nodes, nproc
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.agents: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str, port: int | None = None, extra: list[str] | None = None) -> subprocess.Popen:
        self.ports[name] = port or self.ports.get(name) or free_port()
        cmd = [
            sys.executable,
            "-m",
            "tenplex.cli.main",
            "agent",
            "--nnodes",
            self.nodes,
            "--nproc-per-node",
            str(self.nproc),
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.job,
            "--store-port",
            str(self.ports[name]),
            "--store-memory",
            "1GiB",
            "--run-dir",
            str(self.tmp / name),
            *(extra or []),
            *self.target,
        ]
        log = open(self.tmp / f"agent-{name}.log", "a")  # noqa: SIM115 - owned by the child
        p = subprocess.Popen(
            cmd,
            env=environ(self.tmp),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.tmp,
        )
        log.close()
        self.agents[name] = p
        return p

    def store_pid(self, name: str) -> int:
        text = (self.tmp / name / "store.log").read_text()
        return int(text.split("(pid ", 1)[1].split(")", 1)[0])

    def lose(self, name: str) -> float:
        """The host is lost: its agent and its store SIGKILLed together. When it happened."""
        p, store = self.agents.pop(name), self.store_pid(name)
        t = time.time()
        for pid in (p.pid, store):
            os.kill(pid, signal.SIGKILL)
        p.wait()
        return t

    def leave(self, name: str, timeout: float = 120) -> int:
        """A planned leave: SIGTERM; the agent's workers save at the next step and it ends."""
        p = self.agents.pop(name)
        p.send_signal(signal.SIGTERM)
        return p.wait(timeout)

    def wait(self, what: str, cond: Callable[[], bool], timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            dead = {n: p.returncode for n, p in self.agents.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                logs = "\n".join((self.tmp / f"agent-{n}.log").read_text()[-3000:] for n in self.agents)
                raise AssertionError(f"waiting for {what}: {dead or 'timeout'}\n{logs}")
            time.sleep(0.2)

    def close(self) -> None:
        for name in list(self.agents):
            p = self.agents.pop(name)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.send_signal(signal.SIGINT)  # twice: at once
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for d in self.tmp.glob("*/store.log"):  # stores outlive their agents by design: stop them here
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.store_pid(d.parent.name), signal.SIGTERM)


def rounds(out: Path) -> list[dict[str, Any]]:
    """Each round's records (rank 0's `worker.jsonl` in `out/roundN`): start, ready, steps, done."""
    found = []
    for d in sorted(out.glob("round*"), key=lambda p: int(p.name[5:])):
        recs = read_records(d / "worker.jsonl")[0] if (d / "worker.jsonl").exists() else []
        r: dict[str, Any] = {
            "round": int(d.name[5:]),
            "start": None,
            "ready": None,
            "steps": [],
            "done": None,
        }
        for rec in recs:
            if rec["kind"] in ("fresh", "loaded"):
                r["start"] = rec
            elif rec["kind"] in ("ready", "done"):
                r[rec["kind"]] = rec
            elif rec["kind"] == "step":
                r["steps"].append(rec)
        found.append(r)
    return found


def trained(out: Path, world: int) -> int:
    """Steps trained in rounds of this world size."""
    return sum(len(r["steps"]) for r in rounds(out) if r["ready"] and r["ready"]["world"] == world)


def gaps(out: Path) -> list[dict[str, float]]:
    """Per change: from the old round's last step record to the new round's first, less one step's
    time (a step record is written when its step ends): the downtime as the job saw it."""
    rs = [r for r in rounds(out) if r["steps"]]
    out_ = []
    for a, b in itertools.pairwise(rs):
        step = b["steps"][1]["time"] - b["steps"][0]["time"] if len(b["steps"]) > 1 else 0.0
        gap = b["steps"][0]["time"] - a["steps"][-1]["time"] - step
        out_.append({"round": b["round"], "world": b["ready"]["world"], "downtime": gap})
    return out_


def agent_records(run_dir: Path) -> list[dict[str, Any]]:
    return read_records(run_dir / "agent.jsonl")[0]


def write_table(tmp: Path) -> Path:
    path = tmp / "table.json"
    path.write_text(json.dumps(TABLE))
    return path
