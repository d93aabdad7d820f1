"""The elastic controller: follows the resource schedule, stops the ranks at step boundaries, chooses the
next layout, restarts the ranks in it (they load the newest snapshot), and survives failures.

Ranks are local processes on emulated hosts (one tensor store each); every phase of the job (one layout
on one set of devices) is one process group. Everything that happened is in `timeline.jsonl`.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..ptc import TenplexError
from ..ptc.layout import Layout
from ..train.config import TrainConfig
from ..util import free_port
from .chooser import ChooserError, choose
from .cluster import Cluster
from .live import LiveView
from .records import Records, read_records
from .schedule import Event
from .standby import Role, StandbyPool

MAX_CRASHES = 3  # phases in a row whose ranks die on their own before the job gives up
MAX_STANDBY = 16  # pre-imported rank processes kept ready for the next phase


class JobFailed(TenplexError):
    """The ranks keep crashing: retrying would only loop; their logs say why."""


@dataclass
class RunConfig:
    train: TrainConfig
    schedule: list[Event]
    steps: int
    run_dir: Path
    job: str = "tenplex-job"
    devices_per_host: int = 2
    snapshot_every: int = 5
    table: dict | None = None
    persist: bool = True  # write a DCP snapshot at every reconfiguration (the durable tier)
    quiet: bool = False
    script: list[str] | None = None  # a training script using `ElasticJob`, with its arguments


@dataclass
class Phase:
    index: int
    layout: Layout
    devices: list[str]
    start_step: int
    until: int
    procs: list[Role] = field(default_factory=list)
    dir: Path = Path()
    launched: float = 0.0
    records: list[dict] = field(default_factory=list)
    offset: int = 0
    killed: list[int] = field(default_factory=list)
    failed_at: float | None = None
    last_step: int = -1  # the newest step the ranks reported (loaded, or trained)
    trained: bool = False  # whether a step was trained in this phase
    crashed: bool = False  # a rank died on its own (not a failure the schedule injected)
    done: bool = False  # rank 0 reported the final save committed: the next phase may start

    def __post_init__(self) -> None:
        self.last_step = max(self.last_step, self.start_step)

    def add(self, r: dict) -> None:
        self.records.append(r)
        if r["kind"] in ("step", "loaded", "fresh"):
            self.last_step = max(self.last_step, r["step"])
        self.trained = self.trained or r["kind"] == "step"
        self.done = self.done or r["kind"] == "done"


class Controller:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster = Cluster(cfg.run_dir, cfg.devices_per_host)
        self.timeline = Records(cfg.run_dir / "timeline.jsonl")
        self.live = LiveView(cfg.steps, quiet=cfg.quiet)
        self.started = time.time()
        self.durable: str | None = None
        self.forced: Layout | None = None
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.pool = StandbyPool(cfg.run_dir / "standby.log", env, _die_with_parent)
        self.pool_size = min(MAX_STANDBY, max([e.devices or 0 for e in cfg.schedule] + [1]))
        # the controller's own torch import, off the first reconfiguration's path (joined before any use)
        self._preload = threading.Thread(target=importlib.import_module, args=("tenplex.transformer",))
        self._preload.daemon = True
        self._preload.start()
        self.exiting: list[tuple[Role, float]] = []  # finished phases' ranks tearing down, since

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        finally:
            self.pool.close()
            self._reap(grace=10.0, wait=True)

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        first, rest = cfg.schedule[0], cfg.schedule[1:]
        resumed = self.cluster.restore()
        step = 0
        if resumed:
            self.durable, durable_step = self._newest_durable()
            step = max(self._committed_step(), durable_step)
        by_step = [
            e for e in rest if e.step is not None and e.step >= step and (e.step > step or not resumed)
        ]
        by_time = [e for e in rest if e.time is not None]
        if resumed:
            self.timeline.write("resume", step=step, stores=self.cluster.stores)
            self.live.note(f"resuming job {cfg.job} from its committed step {step}")
        else:
            self.timeline.write(
                "start",
                job=cfg.job,
                steps=cfg.steps,
                schedule=[e.describe() for e in cfg.schedule],
                train=asdict(cfg.train),
            )
        if not self.cluster.allocation:
            self._apply(first, step)
        self.pool.fill(self.pool_size)  # every rank the schedule will need imports from the start
        index, prev, crashes = 0, None, 0
        while step < cfg.steps:
            while by_step and by_step[0].step <= step and not by_step[0].is_failure:
                self._apply(by_step.pop(0), step)
            layout = self._layout(len(self.cluster.allocation))
            until = min([cfg.steps] + [e.step for e in by_step if not e.is_failure])
            phase = self._launch(index, layout, step, until, prev)
            self._monitor(phase, by_step, by_time, prev)
            crashes = crashes + 1 if phase.crashed and not phase.trained else 0  # crashes without progress
            self._give_up_after(crashes, phase)
            if phase.failed_at is not None:
                survivors = self._handle_failure(phase)
                if not survivors:
                    raise JobFailed(f"no devices left after the failure at step {phase.last_step}")
                step = self._committed_step()
                lost = phase.last_step - step
                self.timeline.write("recover", step=step, lost_steps=lost, devices=survivors)
                self.live.note(
                    f"recovering on {len(survivors)} devices from step {step} ({lost} steps to replay)"
                )
            else:
                step = phase.last_step
                while by_time and self._elapsed() >= by_time[0].time:
                    self._apply(by_time.pop(0), step)
                if cfg.persist:  # at every reconfiguration, and the final state at the end
                    self._persist(step)
            prev, index = phase, index + 1
        self.timeline.write("finish", step=step, seconds=self._elapsed(), durable=self.durable)
        self.live.close()
        return {"run_dir": str(cfg.run_dir), "steps": step, "phases": index}

    def _give_up_after(self, crashes: int, phase: Phase) -> None:
        if crashes >= MAX_CRASHES:
            logs = phase.dir / "rank*.log"
            self.timeline.write("give_up", step=phase.last_step, crashes=crashes, logs=str(logs))
            self.live.close()
            raise JobFailed(
                f"ranks crashed in {crashes} phases in a row (the last at step {phase.last_step}): see {logs}"
            )

    def _apply(self, e: Event, step: int) -> None:
        self.cluster.apply(e)
        self.forced = (
            Layout(e.layout.get("dp", 1), e.layout.get("tp", 1), e.layout.get("pp", 1)) if e.layout else None
        )
        self.timeline.write("event", step=step, event=e.describe(), devices=list(self.cluster.allocation))

    def _elapsed(self) -> float:
        return time.time() - self.started

    def _layout(self, devices: int) -> Layout:
        if self.forced is not None and self.forced.world == devices:
            return self.forced
        t = self.cfg.train
        try:
            return choose(t.model, devices, t.global_batch, t.micro_batch, table=self.cfg.table)
        except ChooserError:
            if not self.cfg.script:
                raise
            return Layout(dp=devices)  # only a hint to a script, which lays itself out

    def _match(self, layout: Layout, devices: list[str], prev: Phase | None) -> list[str]:
        """The allocation in rank order, each rank on the device (or host) that holds most of its state.

        The state to load was laid out by the last phase, `prev`; both layouts are the reference model's
        symbolic PTCs, whose names and placements are those of the real job's state.
        """
        if prev is None or self.cfg.script:  # a script's own layout is known only inside it
            return devices
        from ..planner import assign
        from ..ptc import PTCError, gpt_ptc

        was, before, model = prev.layout, prev.devices, self.cfg.train.gpt()

        def ptc(lay: Layout, devs: list[str]):
            on = [(d, Cluster.host_of(d)) for d in devs]
            return gpt_ptc(model, lay.dp, lay.tp, lay.pp, devices=on, zero=3 if lay.fsdp else 0)

        gone = self.cluster.failed_devices | self.cluster.failed_hosts
        lost = [x for x in gone if x in before or any(Cluster.host_of(d) == x for d in before)]
        try:
            return list(assign(ptc(was, before), ptc(layout, devices), lost).mesh.devices)
        except PTCError as e:  # only an optimization: the job runs in allocation order instead
            self.timeline.write("match_skipped", layout=str(layout), error=str(e))
            return devices

    def _newest_durable(self) -> tuple[str | None, int]:
        """The newest persisted DCP snapshot of a previous controller (path, step), if any."""
        done = [p for p in (self.cfg.run_dir / "durable").glob("step-*") if (p / ".metadata").exists()]
        if not done:
            return None, 0
        best = max(done, key=lambda p: int(p.name[5:]))
        return str(best), int(best.name[5:])

    def _committed_step(self) -> int:
        """The step the next phase resumes from: the newest snapshot complete on the live stores."""
        self._preload.join()  # importing the same modules from two threads at once can see half of one
        from ..transformer.snapshot import newest_step

        return newest_step(self.cfg.job, [s["url"] for s in self.cluster.stores.values()]) or 0

    # -- one phase -----------------------------------------------------------------------------------------
    def _launch(self, index: int, layout: Layout, step: int, until: int, prev: Phase | None) -> Phase:
        cfg = self.cfg
        devices = self._match(layout, list(self.cluster.allocation), prev)
        self.cluster.allocation = devices
        self.cluster.save()
        phase = Phase(index, layout, devices, step, until, dir=cfg.run_dir / f"phase{index}")
        phase.dir.mkdir(parents=True, exist_ok=True)
        t = TrainConfig(
            **{
                **asdict(cfg.train),
                "dp": layout.dp,
                "tp": layout.tp,
                "pp": layout.pp,
                "steps": until,
                "total_steps": cfg.train.total_steps or cfg.steps,
                "metrics": None,
            }
        )
        spec = {
            "train": asdict(t),
            "job": cfg.job,
            "until": until,
            "snapshot_every": cfg.snapshot_every,
            "out": str(phase.dir),
            "stop_file": str(phase.dir / "stop"),
            "durable": self.durable,
            "layout": asdict(layout),
        }
        (phase.dir / "spec.json").write_text(json.dumps(spec, indent=1))
        port = free_port()
        self.timeline.write(
            "launch",
            phase=index,
            layout=str(layout),
            devices=devices,
            step=step,
            until=until,
            hosts=sorted({Cluster.host_of(d) for d in devices}),
        )
        self.live.note(
            f"phase {index}: {layout} on {len(devices)} devices "
            f"({', '.join(sorted({Cluster.host_of(d) for d in devices}))}), steps {step}..{until}"
        )
        phase.launched = time.time()
        for rank, device in enumerate(devices):
            env = dict(
                RANK=str(rank),
                WORLD_SIZE=str(len(devices)),
                LOCAL_RANK=device.rsplit("d", 1)[1],
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TENPLEX_STORE=self.cluster.store_url(Cluster.host_of(device)),
                TENPLEX_DEVICE=device,
                TENPLEX_EMULATED_HOSTS="1",
                TENPLEX_SOURCES=",".join(s["url"] for s in self.cluster.stores.values()),
                TENPLEX_WORKER_SPEC=str(phase.dir / "spec.json"),
                TENPLEX_JOB=cfg.job,
            )
            phase.procs.append(self.pool.start(env, phase.dir / f"rank{rank}.log", cfg.script))
        return phase

    def _monitor(self, phase: Phase, by_step: list[Event], by_time: list[Event], prev: Phase | None) -> None:
        """Follow the ranks' records until they exit; fire failure and time events on the way."""
        fails = [e for e in by_step if e.is_failure and phase.start_step <= e.step < phase.until]
        deadline = by_time[0].time if by_time else None
        while True:
            self._take_records(phase, prev)
            for e in list(fails):
                if phase.trained and phase.last_step >= e.step and phase.failed_at is None:
                    fails.remove(e)
                    by_step.remove(e)
                    self._fail(phase, e)
            if deadline is not None and self._elapsed() >= deadline:
                (phase.dir / "stop").touch()
            codes = [p.poll() for p in phase.procs]
            if all(c is not None for c in codes):
                break
            if phase.done and phase.failed_at is None and self.cfg.script and self._overlap_exit():
                # the state is committed: the next phase starts while these ranks tear down
                self.exiting += [(p, time.time()) for p in phase.procs if p.poll() is None]
                break
            if phase.failed_at is None and any(c not in (None, 0) for c in codes):
                self._crashed(phase)  # a rank died on its own: the rest cannot go on
            if phase.failed_at is not None and time.time() - phase.failed_at > 2:
                for p in phase.procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        self._take_records(phase, prev)  # what the ranks wrote just before exiting
        if phase.failed_at is None and any(p.poll() not in (None, 0) for p in phase.procs):
            self._crashed(phase)  # every rank ended before a poll saw one of them die
        for role in phase.procs:
            self.pool.release(role)  # ranks that ended well take ranks of the next phase
        self._reap()

    def _crashed(self, phase: Phase) -> None:
        phase.failed_at = time.time()
        phase.killed = [i for i, p in enumerate(phase.procs) if p.poll() not in (None, 0)]
        phase.crashed = True
        self.timeline.write("crash", phase=phase.index, ranks=phase.killed, step=phase.last_step)

    def _overlap_exit(self) -> bool:
        """Whether a phase may start before the last one's script processes are gone (the reference worker's
        return to the pool instead): not on GPUs, whose memory the old processes hold until they exit."""
        if self.cfg.train.device != "auto":
            return self.cfg.train.device == "cpu"
        import torch

        return not torch.cuda.is_available()

    def _reap(self, grace: float = 10.0, wait: bool = False) -> None:
        """Forget exited ranks of earlier phases; kill those still tearing down after `grace` seconds."""
        for p, since in self.exiting:
            left = since + grace - time.time()
            if wait and left > 0:
                try:
                    p.wait(left)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None and time.time() > since + grace:
                p.kill()
                p.wait()
        self.exiting = [(p, since) for p, since in self.exiting if p.poll() is None]

    def _take_records(self, phase: Phase, prev: Phase | None) -> None:
        """New worker records: into the phase, the timeline and the live view."""
        new, phase.offset = read_records(phase.dir / "worker.jsonl", phase.offset)
        for r in new:
            phase.add(r)
            self.timeline.write(
                "worker",
                phase=phase.index,
                event=r["kind"],
                at=r["time"],
                **{k: v for k, v in r.items() if k not in ("time", "kind")},
            )
            self.live.record(r, phase.layout)
            if r["kind"] == "ready":
                self._report_reconfig(prev, phase)
                # spares import while this one trains: for a larger next layout, and for a failure, after
                # which the surviving ranks' processes end too (their collectives broke)
                self.pool.fill(self.pool_size)

    def _fail(self, phase: Phase, e: Event) -> None:
        ranks = [r for r in e.fail if r < len(phase.procs)]
        hosts = set(e.fail_hosts) & {Cluster.host_of(d) for d in phase.devices}
        ranks += [r for r, d in enumerate(phase.devices) if Cluster.host_of(d) in hosts and r not in ranks]
        if not ranks:
            self.timeline.write("fail_skipped", phase=phase.index, event=e.describe())
            self.live.note(f"{e.describe()}: no such rank or host in the running job, nothing to kill")
            return
        for r in ranks:
            phase.procs[r].kill()
        for h in hosts:
            self.cluster.kill_host(h)
        phase.killed, phase.failed_at = ranks, time.time()
        self.timeline.write(
            "fail",
            phase=phase.index,
            step=phase.last_step,
            ranks=ranks,
            hosts=sorted(hosts),
            devices=[phase.devices[r] for r in ranks],
        )
        self.live.note(
            f"FAILURE at step {phase.last_step}: killed ranks {ranks}"
            + (f" and hosts {sorted(hosts)}" if hosts else "")
        )

    def _handle_failure(self, phase: Phase) -> list[str]:
        """The devices to go on with: an injected failure takes its devices away; a crash (a rank's own
        error) leaves them, and the ranks restart from the newest snapshot."""
        if not phase.crashed:
            self.cluster.fail_devices([phase.devices[r] for r in phase.killed])
        return self.cluster.apply(Event(step=phase.last_step))

    def _persist(self, step: int) -> None:
        self._preload.join()
        import tenplex

        from ..store import StoreError
        from ..transformer import StateError

        path = self.cfg.run_dir / "durable" / f"step-{step}"
        store = next(iter(self.cluster.stores.values()))["url"]
        try:
            info = tenplex.persist(self.cfg.job, step, str(path), store=store)
        except (StoreError, StateError) as e:
            self.timeline.write("persist_failed", step=step, error=str(e))
            return
        self.durable = str(path)
        self.timeline.write(
            "persist", step=step, path=str(path), seconds=info["seconds"], bytes=info["bytes"]
        )

    def _report_reconfig(self, prev: Phase | None, phase: Phase) -> None:
        """Downtime: from the old phase's last step (or the failure) to the new phase's ranks being ready."""
        ready = next((r for r in phase.records if r["kind"] == "ready"), None)
        loaded = next((r for r in phase.records if r["kind"] == "loaded"), None)
        if prev is None or ready is None:
            return
        last_steps = [r for r in prev.records if r["kind"] == "step"]
        saved = next((r for r in prev.records if r["kind"] == "saved"), None)
        since = (
            prev.failed_at
            if prev.failed_at is not None
            else (last_steps[-1]["time"] if last_steps else prev.launched)
        )
        info = {
            "from": str(prev.layout),
            "to": str(phase.layout),
            "step": phase.start_step,
            "failure": prev.failed_at is not None,
            "downtime": ready["time"] - since,
            "save_seconds": saved["seconds"] if saved else None,
            "load_seconds": loaded["seconds"] if loaded else None,
            "build_seconds": ready.get("build_seconds"),
            "bytes": loaded["bytes"] if loaded else {},
            "plan": loaded["plan"] if loaded else {},
            "source": loaded["source"] if loaded else "none",
            "redeploy": not (
                {Cluster.host_of(d) for d in prev.devices} & {Cluster.host_of(d) for d in phase.devices}
            ),
        }
        self.timeline.write("reconfig", **info)
        self.live.reconfig(info)


def _die_with_parent() -> None:
    """Workers die with the controller (Linux); the stores, in sessions of their own, do not."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
