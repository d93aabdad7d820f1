"""A `tenplex run` job on agents: one `tenplex agent` per emulated host (`agent_hosts`), the resource
schedule played by the driver (`driver`), and the run told in the controller's words once it ended
(`agent_timeline`): `timeline.jsonl`, `summary.json` and the plot in the run directory, next to each
round's records (`roundN/`) and each host's agent (`h0/`, `agent-h0.log`).

This is the engine `tenplex run` moves onto (docs/runtime.md, "one runtime"); what it takes from the
run's settings: the reference workload's training flags, the steps, the snapshot interval, the
para-config table, the hosts' network and NICs, the stores' memory and replicas. Not yet: a user's script,
the durable tier, resuming a killed run, the live view.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from ..ptc import TenplexError
from .agent_hosts import AgentJob, Hosts, elastic_target
from .driver import Pool, ScheduleDriver, by_host, foreseen
from .report import plot, summary, write_json
from .runconfig import RunConfig

TRAIN_ARGS = ("model", "global_batch", "micro_batch", "seed", "lr", "warmup", "steps", "device")
END_S = 300.0  # after the schedule's last event, the agents end the job within this (its last steps)


class AgentRunError(TenplexError):
    """A run the agents cannot take yet (a user's script, settings they have no counterpart for), or one
    whose agents failed."""


def max_hosts(cfg: RunConfig) -> int:
    """The most hosts any event of the schedule has at once (the rendezvous' MAX)."""
    allocations = foreseen(cfg.schedule, [], Pool(cfg.devices_per_host))
    return max((len(by_host(a)) for a in allocations), default=1)


class AgentRun:
    """`cfg` played on agents: `run()` plays the schedule to the job's end and returns the summary."""

    def __init__(self, cfg: RunConfig, pace: float = 0.0) -> None:
        if cfg.script:
            raise AgentRunError("a script's run on agents is not there yet: run it with `tenplex agent`")
        unsupported = {"--nic-latency-ms": cfg.nic_latency_ms, "--keep-stores": cfg.keep_stores,
                       "--fresh": cfg.fresh}  # fmt: skip
        if any(unsupported.values()):  # said, not silently dropped
            names = ", ".join(k for k, v in unsupported.items() if v)
            raise AgentRunError(f"not on agents yet: {names}")
        self.cfg, self.pace = cfg, pace
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = cfg.run_dir.resolve()
        self.job: AgentJob | None = None  # once `run` started them: the agents, and what played the schedule
        self.driver: ScheduleDriver | None = None

    def _target(self) -> list[str]:
        cfg, train = self.cfg, asdict(self.cfg.train)
        flags: dict[str, Any] = {f"--{k.replace('_', '-')}": train[k] for k in TRAIN_ARGS}
        flags |= {"--steps": cfg.steps or cfg.train.steps, "--job": cfg.job, "--out": self.run_dir,
                  "--snapshot-every": cfg.snapshot_every or 0, "--min-step-seconds": self.pace}  # fmt: skip
        if cfg.table:
            (self.run_dir / "table.json").write_text(json.dumps(cfg.table))
            flags["--table"] = self.run_dir / "table.json"
        return elastic_target(flags)

    def _agent_flags(self) -> list[str]:
        cfg = self.cfg
        flags = ["--store-memory", str(cfg.store_memory or "1GiB"), *([] if cfg.ahead else ["--no-ahead"])]
        return flags + (["--replicas", str(cfg.replicas)] if cfg.replicas else [])  # else the agents' ring

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        hosts = Hosts(self.run_dir, cfg.network, cfg.nic_gbps)
        try:
            self.job = AgentJob(hosts, cfg.job, self._target(), nodes=f"1:{max_hosts(cfg)}",
                                nproc=cfg.devices_per_host, extra=self._agent_flags())  # fmt: skip
            self.driver = ScheduleDriver(self.job, cfg.schedule, self.run_dir, cfg.devices_per_host)
            self.driver.start()
            self.driver.follow()
            for name, p in list(self.job.agents.items()):
                if p.wait(END_S):
                    raise AgentRunError(f"the agent of {name} failed:\n{self.job._log(name)[-3000:]}")
            self.driver.timeline(cfg.steps, asdict(cfg.train))
        finally:
            if self.job is not None:
                self.job.close()
            hosts.close()
        s = summary(self.run_dir)
        write_json(self.run_dir / "summary.json", s)
        plot(self.run_dir, self.run_dir / "timeline.png")
        return s
