"""An agent's workers on its host: started once, warm before the first round, handed each round through a
TCPStore on loopback, watched until the round ends, restarted only when they died or hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .records import Records
from .rounds import AgentError, Round, has
from .worker import die_with_parent


class Workers:
    """`nproc` worker processes running `target` once per round (`runtime/worker.py`)."""

    def __init__(self, target: list[str], nproc: int, run_id: str, run_dir: Path, records: Records) -> None:
        self.target, self.nproc, self.run_id, self.run_dir, self.records = (
            target,
            nproc,
            run_id,
            run_dir,
            records,
        )
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.address = f"127.0.0.1:{self.store.port}"
        self.inbox = [""] * nproc  # where each slot's process reads its commands (one per process started)
        self.sent = [0] * nproc  # commands sent to each slot's process
        self.spawned = 0
        self.procs = [self._spawn(slot) for slot in range(nproc)]

    def _spawn(self, slot: int) -> subprocess.Popen[bytes]:
        self.spawned += 1
        self.inbox[slot], self.sent[slot] = f"{slot}.{self.spawned}", 0
        environ = dict(
            os.environ,
            TENPLEX_AGENT=self.address,
            TENPLEX_AGENT_SLOT=str(slot),
            TENPLEX_AGENT_INBOX=self.inbox[slot],
            LOCAL_RANK=str(slot),
            LOCAL_WORLD_SIZE=str(self.nproc),
            TORCHELASTIC_RUN_ID=self.run_id,
        )
        with open(self.run_dir / f"worker{slot}.log", "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "tenplex.runtime.worker", *self.target],
                env=environ,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def warm(self) -> None:
        """Until every worker imported what a rank needs (the agent joins only then: a host that joins
        stops the job's workers at once, and its own would otherwise spend that downtime importing)."""
        t = time.time()
        while not all(has(self.store, f"warm/{box}") for box in self.inbox):
            dead = [slot for slot, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                raise AgentError(
                    f"worker {dead[0]} ended before its first round; see {self.run_dir}/worker{dead[0]}.log"
                )
            time.sleep(0.02)
        self.records.write("warm", seconds=time.time() - t)

    def _send(self, slot: int, cmd: dict[str, Any]) -> None:
        self.store.set(f"cmd/{self.inbox[slot]}/{self.sent[slot]}", json.dumps(cmd))
        self.sent[slot] += 1

    def hand(self, rnd: Round) -> None:
        for slot in range(self.nproc):
            self._send(slot, {"kind": "round", "round": rnd.to_json(), "local_world": self.nproc})

    def stop(self, rnd: Round, why: str) -> None:
        """The round stops at its next step boundary (each worker's `ElasticJob.running` asks)."""
        self.store.set(f"stop/{rnd.number}", why)

    def ready(self, rnd: Round) -> bool:
        """Whether the round's ranks have loaded (rank 0 says so, on node 0)."""
        return has(self.store, f"ready/{rnd.number}")

    def ended(self, rnd: Round) -> dict[int, dict[str, Any]]:
        """Workers whose round ended: parked with their outcome, or dead (their process exited)."""
        out: dict[int, dict[str, Any]] = {}
        for slot, proc in enumerate(self.procs):
            key = f"parked/{rnd.number}/{slot}"
            if has(self.store, key):
                out[slot] = json.loads(self.store.get(key))
            elif proc.poll() is not None:
                out[slot] = {"outcome": "dead", "error": f"exit code {proc.returncode}"}
        return out

    def park(self, rnd: Round, timeout: float) -> list[int]:
        """Wait until every worker ended the round; restart those that died or still hang after `timeout`.
        The slots whose round failed (error, dead, hung)."""
        deadline = time.monotonic() + timeout
        while len(ended := self.ended(rnd)) < self.nproc and time.monotonic() < deadline:
            time.sleep(0.01)
        failed = []
        for slot, proc in enumerate(self.procs):
            e = ended.get(slot, {"outcome": "hung"})
            if e["outcome"] in ("dead", "hung"):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                self.procs[slot] = self._spawn(slot)
            if e["outcome"] not in ("done", "stopped"):
                failed.append(slot)
                self.records.write("worker_failed", round=rnd.number, slot=slot, **e)
        return failed

    def close(self) -> None:
        for slot, proc in enumerate(self.procs):
            if proc.poll() is None:
                self._send(slot, {"kind": "exit"})
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
