"""Downtime per membership change: `tenplex agent` against plain torchrun, and `tenplex run`, on the same
hosts with the same reference workload, in one run.

Hosts are network namespaces with 1 Gbit/s NICs (`--network netns`, root; `loopback` otherwise), each
with its own store; the rendezvous runs apart from the agents. The same changes, in the same order, for
each runtime:

1. scale out: host B joins (world 2 -> 4, dp1-tp1-pp2 -> dp2-tp2-pp1);
2. scale in: B leaves as planned (SIGTERM);
3. scale out again: B joins again;
4. host lost: everything on B killed at once (agent, workers, store);
5. A's devices 2 -> 4 while A stays (world 2 -> 4): `tenplex devices` for the agent; torchrun restarts
   A's agent with `--nproc-per-node 4` (the only way it has), `tenplex run` has no such change here.

- agent: `tenplex agent` on each host (defaults: a replica ring, workers kept across rounds);
- torchrun: `python -m torch.distributed.run` with the same c10d settings the agent uses (1 s last call,
  1 s x 3 heartbeats, 0.1 s monitor interval) and the same stores, which the user starts by hand with a
  replica ring of both hosts (without it the lost host ends the job); `TORCH_DISABLE_SHARE_RDZV_TCP_STORE`;
- tenplex run: the local runtime, `--network netns --nic-gbps 1 --replicas 1`, a schedule with the same
  four changes (downtime by the same definition, from its timeline's step records).

Downtime: from the old round's last step to the new round's first, less one step's time (0.2 s steps
here); the agent's in parts too, from its rounds' records (`round_records.round_parts`). For a lost host,
`detect_s` is the part before the new round formed (the agents take a host whose store refuses or is
unreachable out of the rendezvous once a collective breaks; torch's rendezvous drops a silent one after
its heartbeats lapse: 1 s x 3), reported on its own; `after_detect_s` the rest.

    python benchmarks/bench_agent.py                       # netns if root, else loopback: ~4 minutes
    python benchmarks/bench_agent.py --network loopback
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import print_rows, step_gaps, write_results
from tenplex.runtime import netns
from tenplex.runtime.agent_hosts import TABLE, AgentJob, Hosts, Rendezvous, reference_target, wait_until
from tenplex.runtime.records import read_records
from tenplex.runtime.round_records import PARTS, downtimes, trained

CHANGES = [
    "scale out 2 → 4 (join)",
    "scale in 4 → 2 (leave)",
    "scale out 2 → 4 (join again)",
    "host lost 4 → 2",
    "A's devices 2 → 4 (host stays)",
]
RDZV = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
EVERY = 6  # steps each round trains before the next change


def target(tmp: Path, job: str, pace: float) -> list[str]:
    return reference_target(tmp, job, pace, 100_000)


def drive(job, out: Path) -> float:
    """The four changes on `job` (agent or torchrun launcher); when B was lost."""
    job.start("A")
    job.wait("A alone", lambda: trained(out, 2) >= EVERY, 300)
    for _ in range(2):
        t = time.time()
        job.start("B")
        job.wait("world 4", lambda t=t: trained(out, 4, since=t) >= EVERY, 300)
        if _ == 0:
            t = time.time()
            assert job.leave("B") == 0
            job.wait("world 2", lambda t=t: trained(out, 2, since=t) >= EVERY, 300)
    lost = job.lose("B")
    job.wait("world 2 after the loss", lambda: trained(out, 2, since=lost) >= EVERY, 300)
    t = time.time()
    job.devices("A", range(4))
    job.wait("4 devices on A", lambda: trained(out, 4, since=t) >= EVERY, 300)
    return lost


class Torchrun:
    """torchrun agents on the same hosts; each host's store started by hand with a replica ring."""

    def __init__(self, hosts: Hosts, tmp: Path, job: str, pace: float) -> None:
        self.hosts, self.tmp, self.job, self.target = hosts, tmp, job, target(tmp, job, pace)
        self.agents: dict[str, subprocess.Popen] = {}
        self.nproc = {"A": 2, "B": 2}
        self.rdzv = Rendezvous(hosts)
        self.addr = {n: hosts.add(n) for n in ("A", "B")}
        self.port = {n: hosts.port(n, 7070) for n in ("A", "B")}
        self.urls = {n: f"http://{self.addr[n]}:{self.port[n]}" for n in ("A", "B")}
        self.stores: dict[str, subprocess.Popen] = {}
        for name in self.urls:  # the recipe: a store per host, running before its agent (a source
            self._store(name)  # that does not answer is a lost store, not an empty one)

    def _store(self, name: str) -> None:
        if name in self.stores and self.stores[name].poll() is None:
            return
        ring = ",".join(self.urls.values())
        cmd = [
            sys.executable,
            "-m",
            "tenplex.store",
            "--host",
            self.addr[name],
            "--port",
            str(self.port[name]),
            "--memory-limit",
            "1GiB",
            "--peers",
            ring,
            "--replicas",
            "1",
            "--advertise",
            self.urls[name],
        ]
        log = self.tmp / f"store-{name}.log"
        self.stores[name] = self.hosts.popen(name, cmd, self.hosts.environ(), log)
        deadline = time.monotonic() + 30
        while "listening" not in log.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError(f"store {name} did not start")
            time.sleep(0.05)

    def start(self, name: str) -> None:
        self._store(name)
        env = dict(
            self.hosts.environ(),
            TENPLEX_STORE=self.urls[name],
            TENPLEX_SOURCES=",".join(self.urls.values()),
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1:2",
            f"--nproc-per-node={self.nproc[name]}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv.endpoint}",
            f"--rdzv-id={self.job}",
            f"--rdzv-conf={RDZV},is_host=0",
            f"--local-addr={self.addr[name]}",
            "--max-restarts=20",
            "--monitor-interval=0.1",
            *self.target,
        ]
        self.agents[name] = self.hosts.popen(name, cmd, env, self.tmp / f"torchrun-{name}.log")

    def devices(self, name: str, devices: range) -> None:
        """torchrun's way: the host's agent stopped (its workers with it) and started with `devices`."""
        self.leave(name)
        self.nproc[name] = len(devices)
        self.start(name)

    def leave(self, name: str) -> int:
        p = self.agents.pop(name)
        p.terminate()
        return 0 if p.wait(120) is not None else 1

    def lose(self, name: str) -> float:
        self.agents.pop(name, None)
        store = self.stores.pop(name)
        return self.hosts.lose(name, [store.pid])

    def wait(self, what: str, cond, timeout: float) -> None:
        wait_until(what, cond, self.agents, timeout, lambda n: (self.tmp / f"torchrun-{n}.log").read_text())

    def close(self) -> None:
        for p in [*self.agents.values(), *self.stores.values()]:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.rdzv.close()


def measure(kind: str, args: argparse.Namespace, tmp: Path) -> tuple[list[dict], float]:
    """(downtimes, when B was lost) of one runtime."""
    hosts = Hosts(tmp, args.network, args.nic_gbps if args.network == "netns" else None)
    job = (
        AgentJob(hosts, kind, target(tmp, kind, args.pace))
        if kind == "agent"
        else Torchrun(hosts, tmp, kind, args.pace)
    )
    try:
        lost = drive(job, tmp / "out")
    finally:
        job.close()
        hosts.close()
    return downtimes(tmp / "out", tmp if kind == "agent" else None), lost


def detection(tmp: Path, lost: float) -> float:
    """Agent: from B's loss to the next round formed (torch's rendezvous dropped B)."""
    recs = read_records(tmp / "A" / "agent.jsonl")[0]
    return min(r["time"] for r in recs if r["kind"] == "round" and r["time"] > lost) - lost


def tenplex_run(args: argparse.Namespace, tmp: Path) -> list[float]:
    """The same four changes under `tenplex run`, their downtime from its timeline by the agent's
    definition (`common.step_gaps`)."""
    schedule = [
        {"step": 0, "devices": 2},
        {"step": 8, "devices": 4},
        {"step": 16, "devices": 2},
        {"step": 24, "devices": 4},
        {"step": 32, "fail_hosts": ["h1"]},
    ]
    (tmp / "schedule.json").write_text(json.dumps(schedule))
    (tmp / "table.json").write_text(json.dumps(TABLE))
    net = (
        ["--network", "netns", "--nic-gbps", str(args.nic_gbps), "--replicas", "1"]
        if args.network == "netns"
        else []
    )
    cmd = [
        sys.executable,
        "-m",
        "tenplex.cli.main",
        "run",
        "--schedule",
        str(tmp / "schedule.json"),
        "--steps",
        "40",
        "--global-batch",
        "12",
        "--snapshot-every",
        "2",
        "--devices-per-host",
        "2",
        "--para-config",
        str(tmp / "table.json"),
        "--run-dir",
        str(tmp / "run"),
        "--job",
        "run",
        "--quiet",
        *net,
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return step_gaps(tmp / "run")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--network", choices=("netns", "loopback"), default="netns" if not netns.unavailable() else "loopback"
    )
    p.add_argument("--nic-gbps", type=float, default=1.0)
    p.add_argument(
        "--pace", type=float, default=0.2, help="seconds per step (the changes land between steps)"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    found = {}
    for kind in ("agent", "torchrun"):
        (base / kind).mkdir()
        found[kind] = measure(kind, args, base / kind)
        print(kind, [round(d["downtime"], 2) for d in found[kind][0]], flush=True)
    run = tenplex_run(args, base)
    detect = detection(base / "agent", found["agent"][1])
    rows = []
    for i, change in enumerate(CHANGES):
        a, t = found["agent"][0][i]["downtime"], found["torchrun"][0][i]["downtime"]
        row = {
            "change": change,
            "agent_s": a,
            "torchrun_s": t,
            "tenplex_run_s": run[i] if i < len(run) else None,
            "x_torchrun": t / a,
        }
        if change.startswith("host lost"):
            row.update(detect_s=detect, after_detect_s=a - detect)
        row["agent_parts"] = found["agent"][0][i]["parts"]
        rows.append(row)
    meta = {
        "command": "python benchmarks/bench_agent.py"
        + (" --network loopback" if args.network == "loopback" else ""),
        "network": args.network,
        "nic_gbps": args.nic_gbps if args.network == "netns" else None,
        "pace_s": args.pace,
    }
    print_rows(
        "downtime per change (s)",
        rows,
        ["change", "agent_s", "torchrun_s", "tenplex_run_s", "x_torchrun", "detect_s", "after_detect_s"],
    )
    parts = [p for p in PARTS if any(abs(r["agent_parts"][p]) >= 0.005 for r in rows)]
    flat = [{"change": r["change"], **r["agent_parts"]} for r in rows]
    print_rows("tenplex agent: downtime by part (s)", flat, ["change", *parts])
    print(write_results("bench_agent", rows, meta, args.out))


if __name__ == "__main__":
    main()
