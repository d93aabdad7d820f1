"""An agent's workers on its host: forked from a zygote that imported torch once, warm before the first
round, handed each round through a TCPStore on loopback, watched until the round ends, replaced only when
they died or hang.

A worker stuck in a collective of a broken round (gloo cannot abort one) is killed and replaced; a fork of
the zygote (`zygote.py`: the imports are done, the pages shared copy-on-write) takes its slot in a fraction
of a second, where a new interpreter would first import torch for seconds while the job waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..util import env
from .channel import Channel, put, stop_word
from .record_types import Warm, WorkerFailed
from .records import Records
from .rounds import AgentError, Round, has
from .standby import Role, StandbyPool


@dataclass
class Process:
    """One worker process and where its commands go (its own inbox: a replacement never reads another's)."""

    proc: Role
    inbox: str
    sent: int = field(default=0)


class Workers:
    """One worker process per device of the host, running `target` once per round (`runtime/worker.py`).

    A worker belongs to its device for its life (its slot is the device's index): the devices of a round
    are those the host has then (`hand`); a device added gets a new fork, a removed one's worker ends."""

    def __init__(self, target: list[str], nproc: int, run_id: str, run_dir: Path, records: Records) -> None:
        self.target, self.run_id, self.run_dir = target, run_id, run_dir
        self.records = records
        self.channel = Channel("127.0.0.1")
        self.channel.serve()
        self.store = self.channel.store
        self.address = self.channel.address
        # the zygote dies with the agent, the workers with the zygote; in a session of their own, a Ctrl-C
        # reaches only the agent (a planned leave: the workers save first)
        self.pool = StandbyPool(
            run_dir / "zygote.log",
            {**os.environ, env.CHOOSES: "1"},
            self.channel,
            die_with_parent=True,
            session=True,
        )
        self.spawned = 0
        self.slots: dict[int, Process] = {d: self._spawn() for d in range(nproc)}
        self.ahead: dict[int, Process] = {}  # the next round's workers, handed it while this one trains

    def pids(self, rnd: Round) -> list[int]:
        return [self.slots[d].proc.pid for d in rnd.devices]

    def grow(self, devices: list[int]) -> None:
        """A worker for each device that has none, forked now: it warms while the old round saves."""
        for d in devices:
            if d not in self.slots:
                self.slots[d] = self._spawn()

    def _spawn(self) -> Process:
        self.spawned += 1
        inbox = str(self.spawned)
        environ = {
            "TENPLEX_AGENT": self.address,
            "TENPLEX_AGENT_INBOX": inbox,
            "TORCHELASTIC_RUN_ID": self.run_id,
        }
        out = self.run_dir / f"worker-p{inbox}.log"
        return Process(self.pool.start(environ, out, self.target, agent_worker=True), inbox)

    def _warm(self, w: Process) -> bool:
        return has(self.store, f"warm/{w.inbox}")

    def warm(self) -> None:
        """Until every worker imported what a rank needs (the agent joins only then: a host that joins
        stops the job's workers at once, and its own would otherwise spend that downtime importing)."""
        t = time.time()
        while not all(self._warm(w) for w in self.slots.values()):
            dead = [w for w in self.slots.values() if w.proc.poll() is not None]
            if dead:
                raise AgentError(f"a worker ended before its first round; see {self.log(dead[0])}")
            time.sleep(0.02)
        self.records.write(Warm(time.time() - t))

    def log(self, w: Process) -> Path:
        return self.run_dir / f"worker-p{w.inbox}.log"

    def _send(self, w: Process, cmd: dict[str, Any]) -> None:
        put(self.store, f"cmd/{w.inbox}/{w.sent}", json.dumps(cmd))
        w.sent += 1

    def hand(self, rnd: Round, go: bool = True) -> None:
        """Round `rnd` to the workers of its devices, in that order; the workers of devices no longer there
        end (a removed device may be a broken one: nothing of it is kept)."""
        devices = rnd.devices
        self._end(*[self.slots.pop(d) for d in list(self.slots) if d not in devices])
        self.grow(devices)
        if not all(self._warm(self.slots[d]) for d in devices):
            self.warm()
        for i, d in enumerate(devices):
            self._send(self.slots[d], self._round(rnd, i, d))
        if rnd.ahead and go:  # handed ahead elsewhere; here nothing is left to wait for (a new host)
            self.channel.go(rnd.number)

    @staticmethod
    def _round(rnd: Round, position: int, device: int) -> dict[str, Any]:
        return {"kind": "round", "slot": device, "position": position, "round": rnd.to_json(),
                "local_world": len(rnd.devices)}  # fmt: skip

    def hand_ahead(self, rnd: Round, before: Round) -> None:
        """Round `rnd` to other workers while `before`'s still train: a fork for each device whose worker is
        busy (an idle one, of a device added, takes it as it is). They form the round's group and build
        (the reference workload rehearses a step); they load once `before`'s final save committed, when
        its ranks give the turn (`next/N`: each rank to its own host's agent)."""
        put(self.store, f"next/{before.number}", str(rnd.number))
        idle = [d for d in rnd.devices if d in self.slots and d not in before.devices]
        self.ahead = {d: self.slots.pop(d) if d in idle else self._spawn() for d in rnd.devices}
        for i, d in enumerate(rnd.devices):
            self._send(self.ahead[d], self._round(rnd, i, d))

    def take_ahead(self, rnd: Round, go: bool) -> bool:
        """Once the round before `rnd` ended, as the job's agents decided (`go`): the workers handed `rnd`
        ahead take their devices' slots and get the turn (where no rank of this host gave it yet), and the
        old workers end. Else `rnd` is cancelled and its workers killed, loading or not (a load writes
        nothing): False."""
        ahead, self.ahead = self.ahead, {}
        if not go:
            self.channel.cancel(rnd.number)
            self._kill(*ahead.values())
            return False
        self.channel.go(rnd.number)
        old, self.slots = list(self.slots.values()), ahead
        self._end(*old)
        return True

    @staticmethod
    def _kill(*ws: Process) -> None:
        for w in ws:
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()

    def stop(self, rnd: Round, why: str, broken: bool = False, at: int | None = None) -> None:
        """The round stops at its next step boundary, or after step `at` (each worker's
        `ElasticJob.running` asks); a broken one's workers stop at once and also stop waiting on commits
        that wait on the gone (`ElasticJob._wait_commit`). Said again, the newest word counts."""
        if broken:
            put(self.store, f"broken/{rnd.number}", why)
        put(self.store, f"stop/{rnd.number}", stop_word(why, None if broken else at))

    def kill(self, devices: list[int]) -> None:
        """The workers of `devices` killed at once, as a failed device takes its process with it."""
        for d in devices:
            if self.slots[d].proc.poll() is None:
                self.slots[d].proc.kill()

    def ready(self, rnd: Round) -> bool:
        """Whether the round's ranks have loaded (rank 0 says so, on node 0)."""
        return has(self.store, f"ready/{rnd.number}")

    def job(self, rnd: Round) -> str | None:
        """The job's name in the stores, once the round's ranks loaded (rank 0 says it, on node 0)."""
        return self.store.get(f"ready/{rnd.number}").decode() if self.ready(rnd) else None

    def ended(self, rnd: Round) -> dict[int, dict[str, Any]]:
        """Workers whose round ended: parked with their outcome, or dead (their process exited)."""
        out: dict[int, dict[str, Any]] = {}
        for slot in rnd.devices:
            w, key = self.slots[slot], f"parked/{rnd.number}/{slot}"
            if has(self.store, key):
                out[slot] = json.loads(self.store.get(key))
            elif w.proc.poll() is not None:
                out[slot] = {"outcome": "dead", "error": f"exit code {w.proc.returncode}"}
        return out

    def left_s(self, rnd: Round) -> float:
        """While a stop waits for a later step: how long the round's workers will train until it, at their
        pace (infinite: not said)."""
        key = f"reached/{rnd.number}"
        return float(self.store.get(key)) if has(self.store, key) else float("inf")

    def broke(self, rnd: Round) -> dict[int, str]:
        """Workers whose round failed and that are still tearing it down (`worker.py` says so first)."""
        keys = {slot: f"broke/{rnd.number}/{slot}" for slot in rnd.devices}
        return {slot: self.store.get(k).decode() for slot, k in keys.items() if has(self.store, k)}

    def park(self, rnd: Round, timeout: float, broken: float | None = None) -> list[int]:
        """Wait until every worker ended the round; replace those that died or still hang after `timeout`,
        or `broken` after the round is seen to break meanwhile (a worker failed or died: one stuck in a
        collective with it would wait forever). The slots whose round failed (error, dead, hung)."""
        deadline, looks = time.monotonic() + timeout, 0
        while len(ended := self.ended(rnd)) < len(rnd.devices) and time.monotonic() < deadline:
            looks += 1
            broke = any(e["outcome"] in ("error", "dead") for e in ended.values())
            if broken is not None and looks % 10 == 0 and (broke or self.broke(rnd)):
                deadline, broken = min(deadline, time.monotonic() + broken), None
            time.sleep(0.01)
        outcomes = {d: ended.get(d, {"outcome": "hung"}) for d in rnd.devices}
        failed = [d for d, e in outcomes.items() if e["outcome"] not in ("done", "stopped")]
        for slot in failed:
            e = outcomes[slot]
            why = WorkerFailed(
                rnd.number, slot, str(self.log(self.slots[slot])), e["outcome"], e.get("error", "")
            )
            self.records.write(why, **{k: v for k, v in e.items() if k not in ("outcome", "error")})
        self._replace([d for d in failed if outcomes[d]["outcome"] in ("dead", "hung")])
        return failed

    def _replace(self, slots: list[int]) -> None:
        """The slots' processes end (the stacks of those that hang into their logs first, all at once); a
        new fork takes each slot. The round's record keeps the old process's log (`WorkerFailed`)."""
        hung = [self.slots[d].proc for d in slots if self.slots[d].proc.poll() is None]
        for p in hung:
            p.send_signal(signal.SIGUSR1)  # where it hangs, into its log (faulthandler)
        if hung:
            time.sleep(0.1)
        self._kill(*(self.slots[d] for d in slots))
        for d in slots:
            self.slots[d] = self._spawn()

    def _end(self, *ws: Process) -> None:
        """The workers told to exit, all at once, then waited for (killed after 10 s)."""
        for w in ws:
            if w.proc.poll() is None:
                self._send(w, {"kind": "exit"})
        for w in ws:
            try:
                w.proc.wait(10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()

    def close(self) -> None:
        self._kill(*self.ahead.values())  # handed a round that never went: nothing of theirs is needed
        self._end(*self.slots.values())
        self.pool.close()
