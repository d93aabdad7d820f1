"""The elastic controller: follows the resource schedule, stops the ranks at step boundaries, chooses the
next layout, restarts the ranks in it (they load the newest snapshot), and survives failures.

The parts: this schedule loop (layout choice, failures, the durable tier), `launcher` (spec, environment,
processes), `monitor` (records, injected failures, crashes), `placement` (which device each rank runs on),
`downtime` (what each change cost), `hosts` (emulated hosts and their stores). Every phase of the job (one
layout on one set of devices) is one process group. Everything that happened is in `timeline.jsonl`.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from dataclasses import asdict, replace
from typing import Any

from ..ptc import TenplexError
from ..ptc.layout import Layout
from ..util import env, logs
from .ahead import Ahead, StartsAhead
from .channel import Channel
from .chooser import ChooserError, choose
from .downtime import reconfiguration
from .durable_tier import DurableTier
from .hosts import EmulatedHosts, host_of
from .launcher import Launcher
from .live import LiveView
from .monitor import Monitor, catch_up
from .notices import lost_line, notice
from .phase import Phase
from .placement import MatchSkipped, match
from .record_types import (
    Applied,
    Finish,
    GiveUp,
    Launch,
    Network,
    Reconfig,
    Recover,
    Resume,
    Start,
    StoresLost,
    Unmatched,
)
from .records import Kind, Records
from .runconfig import RunConfig
from .schedule import Event
from .spec import OPEN_END, WorkerSpec

log = logs.get("runtime")

MAX_CRASHES = 3  # phases in a row whose ranks die on their own, none past the last crash, before giving up
MAX_STANDBY = 16  # pre-imported rank processes kept ready for the next phase


class JobFailed(TenplexError):
    """The ranks keep crashing: retrying would only loop; their logs say why."""


class Controller(StartsAhead):
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        # the job's record of its stores lives with the run (this process and every rank it starts): another
        # run of the same job name elsewhere is another job
        os.environ[env.STATE_DIR] = str(cfg.run_dir.resolve())
        memory = {} if cfg.store_memory is None else {"memory_limit": str(cfg.store_memory)}
        if cfg.network == "netns":
            from .netns_hosts import NamespaceHosts, NamespaceLauncher

            self.hosts: EmulatedHosts = NamespaceHosts(
                cfg.run_dir, cfg.devices_per_host, cfg.nic_gbps, cfg.nic_latency_ms, cfg.replicas, **memory
            )
        else:
            self.hosts = EmulatedHosts(cfg.run_dir, cfg.devices_per_host, **memory)
        self.timeline = Records(cfg.run_dir / "timeline.jsonl")
        self.live = LiveView(cfg.steps, quiet=cfg.quiet)
        self.end = OPEN_END if cfg.steps is None else cfg.steps  # a script's own, once its ranks say it
        self.started = time.time()
        self.forced: Layout | None = None
        pool_size = min(MAX_STANDBY, max([e.devices or 0 for e in cfg.schedule] + [1]))
        # the signals to the ranks (stop, turn, fired, exit codes): a store served once torch is imported
        self.channel = Channel(self.hosts.control_host)  # (`_warm`)
        make = NamespaceLauncher if cfg.network == "netns" else Launcher
        self.launcher = make(cfg.run_dir, self.hosts, pool_size, self.channel)
        self.monitor = Monitor(
            self.timeline, self.live, self.hosts, self.launcher, self.channel, self._on_record
        )
        self._prev: Phase | None = None
        self._next: tuple[Phase, list[Event]] | None = None  # a phase whose successor may start ahead
        self._ahead: Ahead | None = None  # that successor, once started
        self._said_overrides = False
        # the controller's own torch import, off the first reconfiguration's path (joined before any use)
        self._preload = threading.Thread(target=self._warm)
        self._preload.daemon = True
        self._preload.start()
        self.tier = DurableTier(cfg.run_dir / "durable", cfg.job, self.timeline, self._preload)

    def _warm(self) -> None:
        """The controller's torch import, then its channel's store (the ranks connect when they need it)."""
        self.channel.serve()
        importlib.import_module("tenplex.transformer")

    @property
    def durable(self) -> str | None:
        """The newest DCP checkpoint of the run (None: none yet)."""
        return self.tier.path

    # -- the loop ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            return self._run()
        except BaseException:
            if self.cfg.network == "netns":  # nothing of the run's network outlives a failed run
                self.launcher.close()
                self.hosts.shutdown()
            raise
        finally:
            self.launcher.close()
            self.monitor.reap(grace=10.0, wait=True)
            self.channel.close()  # no rank is left to ask it

    def _begin(self) -> tuple[int, list[Event], list[Event]]:
        """Start the job, or resume it from its committed step (a rerun of the same run directory): that
        step, and the schedule's events still to come by step and by time."""
        cfg = self.cfg
        first, rest = cfg.schedule[0], cfg.schedule[1:]
        resumed = self.hosts.restore()
        step = max(self._committed_step(), self.tier.newest()) if resumed else 0
        by_step = [
            e for e in rest if e.step is not None and e.step >= step and (e.step > step or not resumed)
        ]
        by_time = [e for e in rest if e.time is not None]
        if resumed:
            caught_up = catch_up(self.timeline, cfg.run_dir, self._next_phase())
            self.timeline.write(Resume(step, self.hosts.stores, caught_up))
            self.live.note(f"resuming job {cfg.job} from its committed step {step}")
        else:
            schedule = [e.describe() for e in cfg.schedule]
            train = asdict(cfg.train)
            self.timeline.write(Start(cfg.job, cfg.steps, schedule, train))
        if not self.hosts.allocation:
            self._apply(first, step)
        return step, by_step, by_time

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        step, by_step, by_time = self._begin()
        self.launcher.fill(starting=True)  # every rank the schedule will need imports from the start
        index, prev, crashes, crashed_at = self._next_phase(), None, 0, -1
        ahead: Ahead | None = None
        while step < self.end:
            while by_step and by_step[0].step <= step and not by_step[0].is_failure:
                self._apply(by_step.pop(0), step)
            layout = self._layout(len(self.hosts.allocation), self.forced)
            until = min([self.end] + [e.step for e in by_step if not e.is_failure])
            failures = [e.step for e in by_step if e.is_failure and step <= e.step < until]
            phase = self._take(ahead, layout, step, until, prev, failures)
            if phase is None:
                phase = self._launch(index, layout, step, until, prev, failures)
            stop_at = self.started + by_time[0].time if by_time else None  # the next time event
            self._next = (phase, by_step) if self._may_go_ahead(phase, by_step, by_time) else None
            if self._next is not None and prev is None:  # the job's start is no change to slow down
                self._ahead, self._next = self._go_ahead(*self._next), None
            try:
                self.monitor.watch(phase, by_step, stop_at, bool(cfg.script) and self._on_cpus())
            finally:
                ahead, self._ahead, self._next = self._ahead, None, None
                if ahead is not None and not ahead.go_given and ahead.cancel(self.launcher.release):
                    ahead = None  # the phase ended otherwise: not the plan
            self._no_room_for(phase)
            # told to go (`ahead`): this phase's final save committed, whatever its teardown did
            if phase.crashed and ahead is None:  # without progress: no step trained, or none past the last
                crashes = 0 if phase.trained and phase.last_step > crashed_at else crashes + 1  # crash
                crashed_at = max(crashed_at, phase.last_step)
            else:
                crashes = 0
            self._give_up_after(crashes, phase)
            if phase.failed_at is not None and ahead is None:
                survivors = self._handle_failure(phase)
                if not survivors:
                    raise JobFailed(f"no devices left after the failure at step {phase.last_step}")
                step = self._committed_step()
                lost = phase.last_step - step
                self.timeline.write(Recover(step, lost, survivors))
                self.live.note(
                    f"recovering on {len(survivors)} devices from step {step} ({lost} steps to replay)"
                )
            else:
                step = phase.last_step
                while by_time and self._elapsed() >= by_time[0].time:
                    self._apply(by_time.pop(0), step)
                if cfg.persist:  # at every reconfiguration, and the final state at the end
                    store = self.hosts.stores[host_of(phase.devices[0])]["url"]  # it holds the phase's saves
                    phase.persist_seconds = self.tier.behind(step, store)
            prev, index = phase, index + 1
        self.tier.join()
        self._network()
        self.timeline.write(Finish(step, self._elapsed(), self.durable))
        self.live.close()
        return {"run_dir": str(cfg.run_dir), "steps": step, "phases": index}

    def _next_phase(self) -> int:
        """The index of this controller's first phase: after every phase directory an earlier (killed)
        controller of the run left, so a rerun never appends to their records and ledgers, and the report
        reads its phases after theirs (the rerun replays from the committed step: its record wins)."""
        dirs = [p.name[5:] for p in self.cfg.run_dir.glob("phase*") if p.is_dir()]
        return max((int(n) for n in dirs if n.isdigit()), default=-1) + 1

    def _network(self) -> None:
        """Namespace hosts: each host's address and bytes in/out so far, into the timeline."""
        if self.cfg.network == "netns" and self.hosts.net.hosts:  # type: ignore[attr-defined]
            self.timeline.write(Network(self.hosts.network()))  # type: ignore[attr-defined]

    def _no_room_for(self, phase: Phase) -> None:
        """A final save that did not fit in the stores even with only the newest snapshot kept ends the job:
        every later layout could only go back to an older step (and run into the same wall)."""
        failed = next((r for r in phase.records if r["kind"] == Kind.SAVE_FAILED), None)
        if failed is None:
            return
        self.timeline.write(GiveUp(failed["step"], error=failed["error"]))
        self.live.close()
        raise JobFailed(
            f"the state at step {failed['step']} does not fit in the stores: {failed['error']} "
            "(give them more memory: --store-memory)"
        )

    def _give_up_after(self, crashes: int, phase: Phase) -> None:
        if crashes >= MAX_CRASHES:
            logs = phase.dir / "rank*.log"
            self.timeline.write(GiveUp(phase.last_step, crashes=crashes, logs=str(logs)))
            self.live.close()
            raise JobFailed(
                f"ranks crashed in {crashes} phases in a row (the last at step {phase.last_step}): see {logs}"
            )

    def _apply(self, e: Event, step: int) -> None:
        self.hosts.apply(e)
        self.forced = e.forced
        self.timeline.write(Applied(step, e.describe(), list(self.hosts.allocation)))

    def _elapsed(self) -> float:
        return time.time() - self.started

    def _layout(self, devices: int, forced: Layout | None) -> Layout | None:
        """The layout of the next phase: the schedule's (`forced`, named by the last event applied), else
        the chooser's; a script lays itself out (None) unless the schedule names a layout."""
        if forced is not None and forced.world == devices:
            return forced
        if self.cfg.script:
            return None
        t = self.cfg.train
        try:
            chosen = choose(t.model, devices, t.global_batch, t.micro_batch, table=self.cfg.table)
        except ChooserError as e:
            raise ChooserError(f"{e} (the schedule asks for {devices} devices)") from None
        return replace(chosen, fsdp=t.fsdp)

    def _place(self, layout: Layout | None, devices: list[str], prev: Phase | None) -> list[str]:
        """The allocation in rank order, each rank where most of its state lies (see `placement`)."""
        if layout is None or self.cfg.script or prev is None or prev.placed is None:
            return devices  # nothing to load, or a script's layout: known only inside it
        gone = self.hosts.failed_devices | self.hosts.failed_hosts
        try:
            return match(prev.placed, layout, devices, gone, self.cfg.train.state_ptc)
        except MatchSkipped as e:  # only an optimization: the job runs in allocation order instead
            self.timeline.write(Unmatched(str(layout), str(e)))
            log.info("ranks of %s placed in allocation order: %s", layout, e)
            return devices

    def _committed_step(self) -> int:
        """The step the next phase resumes from: the newest snapshot complete on the live stores."""
        self._preload.join()  # importing the same modules from two threads at once can see half of one
        from ..transformer import StoresLostError
        from ..transformer.snapshot import newest_step

        try:
            return newest_step(self.cfg.job, [s["url"] for s in self.hosts.stores.values()]) or 0
        except StoresLostError as e:  # the previous run's stores are gone: resume only from what is left
            self.timeline.write(StoresLost(e.lost, durable=self.durable, fresh=self.cfg.fresh))
            if self.durable is None and not self.cfg.fresh:
                raise
            if self.durable is None:  # --fresh: the run's record named the lost stores; a new one starts
                from ..transformer import jobrecord

                jobrecord.forget(self.cfg.job)
            what = f"its persisted snapshot {self.durable}" if self.durable else "step 0 (--fresh)"
            self.live.note(f"the stores of job {self.cfg.job} are lost ({lost_line(e.lost)}); "
                           f"starting from {what}")  # fmt: skip
            return 0

    # -- one phase -----------------------------------------------------------------------------------------
    def _spec(self, phase: Phase) -> WorkerSpec:
        cfg = self.cfg
        train = None
        if not cfg.script:
            t = replace(cfg.train, steps=phase.until, total_steps=cfg.train.total_steps or cfg.steps)
            train = asdict(replace(t, metrics=None))
        return WorkerSpec(
            job=cfg.job,
            until=phase.until,
            steps=cfg.steps,
            snapshot_every=cfg.snapshot_every,
            out=str(phase.dir),
            control=self.channel.address,
            phase=phase.index,
            durable=self.durable,
            layout=phase.layout,
            train=train,
            failures=phase.failures,
            fresh=cfg.fresh,
        )

    def _launch(
        self,
        index: int,
        layout: Layout | None,
        step: int,
        until: int,
        prev: Phase | None,
        failures: list[int],
    ) -> Phase:
        devices = self._place(layout, list(self.hosts.allocation), prev)
        phase = self._phase(index, layout, devices, step, until, failures)
        self._announce(phase, prev)
        self.launcher.launch(phase, self._spec(phase), self.cfg.script)
        self._network()
        return phase

    def _phase(
        self, index: int, layout: Layout | None, devices: list[str], step: int, until: int, fails: list[int]
    ) -> Phase:
        phase = Phase(index, layout, devices, step, until, dir=self.cfg.run_dir / f"phase{index}")
        phase.failures = sorted({phase.due(s) for s in fails if phase.due(s) < until})
        phase.dir.mkdir(parents=True, exist_ok=True)
        phase.launched = time.time()
        return phase

    def _announce(self, phase: Phase, prev: Phase | None, ahead: bool | None = None) -> None:
        """The phase's devices become the allocation; its launch goes into the timeline and the live view."""
        self.hosts.allocation = phase.devices
        self.hosts.save()
        hosts = sorted({host_of(d) for d in phase.devices})
        self.timeline.write(
            Launch(phase.index, phase.label, phase.devices, phase.start_step, phase.until, hosts, ahead=ahead)
        )
        on = f"{len(phase.devices)} devices ({', '.join(hosts)})"
        self.live.note(f"phase {phase.index}: {phase.label} on {on}, steps {phase.start_step}..{phase.until}")
        self._prev = prev

    def _on_record(self, phase: Phase, r: dict) -> None:
        """Once the new ranks are ready, start spares while this phase trains (for a larger next layout,
        and for a failure, after which the survivors' processes end too); once they trained their first
        step (or ended without one), report the change."""
        if r["kind"] == Kind.READY:
            self.launcher.fill()
        if r["kind"] == Kind.SETTINGS:
            self._settings(r)
        self._ahead_on_record(phase, r)
        notice(self.timeline, self.live, phase, r)
        first = r["kind"] == Kind.STEP and sum(x["kind"] == Kind.STEP for x in phase.records) == 1
        if first or (r["kind"] == Kind.DONE and not phase.trained):
            info = reconfiguration(self._prev, phase)
            if info is not None:
                self.timeline.write(Reconfig(), **info)
                self.live.reconfig(info)

    def _settings(self, r: dict) -> None:
        """A script's own step count ends a run that named none; a command line that replaced the script's
        own settings says so, once."""
        if self.cfg.steps is None and r.get("steps") is not None:
            self.end = self.live.steps = r["steps"]
        if r.get("overridden") and not self._said_overrides:
            self._said_overrides = True
            print(
                "[tenplex] the command line overrides the script's own: " + "; ".join(r["overridden"]),
                flush=True,
            )

    def _on_cpus(self) -> bool:
        """Whether the job's devices are CPUs: then a phase may start before the last one's processes are
        gone (a script's exit; a phase started ahead), not on GPUs, whose memory the old processes hold."""
        if self.cfg.train.device != "auto":
            return self.cfg.train.device == "cpu"
        self._preload.join()  # torch is being imported in that thread
        import torch

        return not torch.cuda.is_available()

    def _handle_failure(self, phase: Phase) -> list[str]:
        """The devices to go on with: an injected failure takes its devices away; a crash (a rank's own
        error) leaves them, and the ranks restart from the newest snapshot."""
        if not phase.crashed:
            self.hosts.fail_devices([phase.devices[r] for r in phase.killed])
        return self.hosts.apply(Event(step=phase.last_step))
