"""Agents of one job on this machine, each an emulated host: loopback (its own store port) or a network
namespace (its own address and shaped NIC, `runtime/netns.py`). Tests and the agent benchmark drive
them; the rendezvous endpoint runs apart from the agents (`tenplex rendezvous`), as on a cluster.

A host is lost as a real one is: everything on it killed at once (the agent, its workers, its store).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..util import free_port
from . import netns
from .agent_timeline import placements
from .hosts import device_index, host_of
from .round_records import records
from .rounds import AgentError

RDZV_PORT = 29400
# the reference workload's layouts in the agent tests and benchmark: a change of world moves tp and pp too
TABLE = {"2": {"dp": 1, "tp": 1, "pp": 2}, "4": {"dp": 2, "tp": 2, "pp": 1}}


def reference_target(run_dir: Path, job: str, pace: float, steps: int) -> list[str]:
    """An agent's target: the reference workload (tiny GPT, snapshot every 2 steps, `pace` s per step,
    layouts from `TABLE`), records under `run_dir/out`."""
    (run_dir / "table.json").write_text(json.dumps(TABLE))
    flags = {
        "--model": "tiny",
        "--steps": steps,
        "--global-batch": 12,
        "--job": job,
        "--snapshot-every": 2,
        "--min-step-seconds": pace,
        "--out": "out",
        "--table": run_dir / "table.json",
    }
    return elastic_target(flags)


def elastic_target(flags: dict[str, Any]) -> list[str]:
    """An agent's target: the reference workload's rank (`runtime/elastic.py`) with `flags`."""
    return ["-m", "tenplex.runtime.elastic", *(str(x) for kv in flags.items() for x in kv)]


class Hosts:
    """Emulated hosts: where a process runs and at which address the others reach it."""

    def __init__(self, run_dir: Path, network: str = "loopback", gbps: float | None = None) -> None:
        self.run_dir, self.network = run_dir, network
        self.net = (
            netns.Network(netns.prefix_for(str(run_dir.resolve())), gbps) if network == "netns" else None
        )
        self.procs: dict[str, list[subprocess.Popen]] = {}

    def add(self, name: str, shaped: bool = True) -> str:
        """The host's address (made on first use)."""
        if self.net is None:
            return "127.0.0.1"
        return self.net.add_host(name, shaped).addr

    def port(self, name: str, default: int) -> int:
        """A port for a service of host `name`: the default in a namespace (every host has its own
        ports), a free one on loopback (they share this machine's)."""
        return default if self.net is not None else free_port()

    def popen(
        self, name: str, argv: list[str], env: dict[str, str], log: Path, pipes: bool = False
    ) -> subprocess.Popen:
        """`argv` on host `name`, its output into `log` (`pipes`: its stdin and stdout are the caller's,
        text lines; its stderr into `log`)."""
        with open(log, "a") as out:
            kw: dict[str, Any] = {
                "env": env,
                "stdout": subprocess.PIPE if pipes else out,
                "stderr": out if pipes else subprocess.STDOUT,
                "stdin": subprocess.PIPE if pipes else subprocess.DEVNULL,
                "cwd": self.run_dir,
                "text": pipes,
            }
            p = self.net.popen(name, argv, **kw) if self.net is not None else subprocess.Popen(argv, **kw)
        self.procs.setdefault(name, []).append(p)
        return p

    def run(self, name: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """`argv` on host `name`, to its end (a command such as `tenplex status` reaches the job's
        addresses only from inside the network)."""
        argv = self.net.hosts[name].argv(argv) if self.net is not None else argv
        return subprocess.run(argv, env=self.environ(), capture_output=True, text=True, timeout=timeout)

    def environ(self) -> dict[str, str]:
        env = dict(os.environ, TENPLEX_EMULATED_HOSTS="1", TENPLEX_STATE_DIR=str(self.run_dir / "state"))
        if self.net is not None:
            env["GLOO_SOCKET_IFNAME"] = netns.NIC  # gloo on the host's own interface
        for name in ("TENPLEX_STORE", "TENPLEX_SOURCES"):
            env.pop(name, None)
        return env

    def lose(self, name: str, extra: Sequence[int] = ()) -> float:
        """Everything on host `name` killed at once (`extra`: its processes in sessions of their own on a
        loopback host); when it happened."""
        t = time.time()
        if self.net is not None:
            self.net.kill_host(name)
        else:
            for pid in [*(p.pid for p in self.procs.get(name, [])), *extra]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in self.procs.pop(name, []):
            p.wait()
        return t

    def close(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if self.net is not None:
            self.net.close()


class Rendezvous:
    """A job's rendezvous endpoint on a host of its own (`tenplex rendezvous`): no agent hosts it, so
    any of them may come and go."""

    def __init__(self, hosts: Hosts) -> None:
        # loopback: a port the kernel picks as the store binds it (one picked free here first could be
        # another connection's source port by the time the command binds it, seconds later)
        addr, port = hosts.add("rdzv", shaped=False), RDZV_PORT if hosts.net is not None else 0
        cmd = [sys.executable, "-m", "tenplex.cli.main", "rendezvous", "--host", addr, "--port", str(port)]
        log = hosts.run_dir / "rendezvous.log"
        self.proc = hosts.popen("rdzv", cmd, hosts.environ(), log)
        wait_until("the rendezvous", lambda: "listening on" in log.read_text(), {"rdzv": self.proc}, 30)
        self.endpoint = log.read_text().split("listening on ", 1)[1].split()[0]  # ADDR:PORT

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def wait_until(
    what: str,
    cond: Callable[[], bool],
    procs: dict[str, subprocess.Popen],
    timeout: float,
    logs: Callable[[str], str] = lambda name: "",
) -> None:
    """Until `cond`; one of `procs` ending meanwhile, or the timeout, fails with their logs."""
    deadline = time.monotonic() + timeout
    while not cond():
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead or time.monotonic() > deadline:
            text = "\n".join(logs(n)[-3000:] for n in procs)
            raise AgentError(f"waiting for {what}: {dead or 'timeout'}\n{text}")
        time.sleep(0.1)


class AgentJob:
    """One job's agents on `hosts`: started, stopped (a planned leave), lost; the rendezvous apart."""

    def __init__(
        self,
        hosts: Hosts,
        job: str,
        target: list[str],
        nodes: str = "1:2",
        nproc: int = 2,
        extra: Sequence[str] = (),
    ) -> None:
        """`extra`: more flags for every agent (a `--store-memory` there replaces the default 1GiB)."""
        self.hosts, self.job, self.target, self.nodes, self.nproc = hosts, job, target, nodes, nproc
        self.extra = list(extra)
        self.agents: dict[str, subprocess.Popen] = {}
        self.leaving: dict[str, subprocess.Popen] = {}  # told to leave, not ended yet
        self.asker: subprocess.Popen | None = None  # `ask`'s process, started on the first ask
        self.nprocs: dict[str, int] = {}  # host -> the workers its agent was started with
        self.stores: dict[str, int] = {}  # host -> store port
        self.rdzv = Rendezvous(hosts)
        self.endpoint = self.rdzv.endpoint

    def start(self, name: str, nproc: int | None = None, standby: bool = False) -> subprocess.Popen:
        """The agent of host `name`, with `nproc` workers (the job's default: `self.nproc`); `standby`: a
        warm spare that joins once let in (`tenplex admit`)."""
        addr = self.hosts.add(name)
        self.nprocs[name] = nproc or self.nproc
        self.stores.setdefault(name, self.hosts.port(name, 7070))
        cmd = [
            sys.executable,
            "-m",
            "tenplex.cli.main",
            "agent",
            "--nnodes",
            self.nodes,
            "--nproc-per-node",
            str(self.nprocs[name]),
            *(["--standby"] if standby else []),
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.job,
            "--rdzv-conf",
            "is_host=false",
            "--advertise",
            addr,
            "--store-port",
            str(self.stores[name]),
            *([] if "--store-memory" in self.extra else ["--store-memory", "1GiB"]),
            "--run-dir",
            str(self.hosts.run_dir / name),
            *self.extra,
            *self.target,
        ]
        p = self.hosts.popen(name, cmd, self.hosts.environ(), self.hosts.run_dir / f"agent-{name}.log")
        self.agents[name] = p
        return p

    def devices(self, name: str, devices: Sequence[int], at: int | None = None, failed: bool = False) -> None:
        """Host `name`'s devices become `devices` (`tenplex devices`), at step `at` or the next boundary;
        `failed`: those left out fail now."""
        listed = ",".join(map(str, devices))
        self.ask("devices", self.store_url(name), listed, *(["--failed"] if failed else []), at=at)

    def open_asker(self) -> None:
        """The process for the asks (`ask`), started now if it is not: it imports torch once, before any."""
        if self.asker is None:
            argv = [sys.executable, "-m", "tenplex.cli.asker"]
            log = self.hosts.run_dir / "asker.log"
            self.asker = self.hosts.popen("rdzv", argv, self.hosts.environ(), log, pipes=True)

    def ask(self, *args: str, at: int | None = None) -> str:
        """`tenplex ARGS` for this job (devices, layout, stop), from the rendezvous' host, through one
        process kept for the asks (`cli/asker.py`: no interpreter started per ask); what it printed."""
        self.open_asker()
        when = [] if at is None else ["--at-step", str(at)]
        asked = [*args, "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job, *when]
        assert self.asker is not None and self.asker.stdin is not None and self.asker.stdout is not None
        self.asker.stdin.write(json.dumps(asked) + "\n")
        self.asker.stdin.flush()
        line = self.asker.stdout.readline()
        if not line:
            raise AgentError(f"the asker ended: {(self.hosts.run_dir / 'asker.log').read_text()[-2000:]}")
        done = json.loads(line)
        if done["code"]:
            raise AgentError(f"tenplex {args[0]}: {done['err'].strip()}")
        return done["out"]

    def waiting(self, name: str) -> bool:
        """Whether host `name`'s agent is a spare that waits, warm, to be let in (its last record says so)."""
        recs = records(self.hosts.run_dir / name / "agent.jsonl")
        return name in self.agents and bool(recs) and recs[-1]["kind"] == "standby"

    def ranks(self) -> list[tuple[str, int]]:
        """(host, device) of every rank of the newest round, in rank order (`agent_timeline.placements`)."""
        placed = placements(self.hosts.run_dir)
        return [(host_of(d), device_index(d)) for d in placed[max(placed)]] if placed else []

    def store_url(self, name: str) -> str:
        return f"http://{self.hosts.add(name)}:{self.stores[name]}"

    def store_pid(self, name: str) -> int:
        text = (self.hosts.run_dir / name / "store.log").read_text()
        return int(text.rsplit("(pid ", 1)[1].split(")", 1)[0])

    def leave(self, name: str, timeout: float = 120, wait: bool = True) -> int | None:
        """A planned leave: SIGTERM; the agent's workers save at the next step boundary (or the step the
        job asked for), and it ends; its exit code (`wait`), else see `ended`."""
        p = self.leaving[name] = self.agents.pop(name)
        p.send_signal(signal.SIGTERM)
        return self.ended(name, timeout) if wait else None

    def dismiss(self, name: str, timeout: float = 30) -> None:
        """Host `name`'s agent sent away, whatever it was doing (a spare of a job that ended): SIGTERM,
        then killed if it does not end."""
        p = self.agents.pop(name)
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def ended(self, name: str, timeout: float = 120) -> int:
        """The exit code of the agent told to leave; one that failed is an error, with its log."""
        code = self.leaving.pop(name).wait(timeout)
        if code:
            raise AgentError(f"the agent of {name} left with exit code {code}:\n{self._log(name)[-3000:]}")
        return code

    def cut(self, name: str) -> float:
        """Host `name`'s link down (namespace hosts): nothing reaches it, no error either; its agent is no
        longer the job's (it is killed with the hosts at the end)."""
        assert self.hosts.net is not None
        t = time.time()
        self.hosts.net.partition(name)
        self.agents.pop(name)
        return t

    def lose(self, name: str) -> float:
        self.agents.pop(name, None)
        return self.hosts.lose(name, [self.store_pid(name)])

    def wait(self, what: str, cond: Callable[[], bool], timeout: float = 150) -> None:
        wait_until(what, cond, self.agents, timeout, self._log)

    def _log(self, name: str) -> str:
        return (self.hosts.run_dir / f"agent-{name}.log").read_text()

    def close(self) -> None:
        """Every agent told to go at once (SIGINT twice), then whatever is left killed; stores stopped."""
        if self.asker is not None:  # its stdin closed, it ends (else `Hosts.close` kills it)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.asker.communicate(timeout=10)
        self.agents.update(self.leaving)
        self.leaving.clear()
        for name in list(self.agents):
            p = self.agents.pop(name)
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in self.hosts.run_dir.glob("*/store.log"):  # stores outlive their agents by design
            with contextlib.suppress(ProcessLookupError, ValueError, IndexError):
                os.kill(self.store_pid(log.parent.name), signal.SIGTERM)
        self.rdzv.close()
