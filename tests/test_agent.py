"""`tenplex agent` on emulated hosts (loopback, and network namespaces with 1 Gbit/s NICs): a host joins,
is lost (agent, workers and store killed at once), a warm spare on a new host is let in at an asked step,
then leaves at one; the job ends on the first host. The rendezvous endpoint runs apart from the agents
(`tenplex rendezvous`). Then changes of devices and layout at asked steps, `tenplex run`'s schedules
played on agents (`runtime/driver.py`), a persisted checkpoint, a cut-off host, a user's FSDP2 script.

Checked: the first host's workers are the same processes from a round to the round after a failure, or
after any change with `--no-ahead` (kept, never restarted), and a planned change's round is handed to
workers forked while the round before trains (`ahead` in its ready record); every
round after the first loads a snapshot (never a fresh start while one survives: the lost host's shards
come from their replica); the recovery's record names the lost store; every sample is used exactly once;
the losses equal a static run's; `tenplex status` shows the agents and `tenplex stop` ends a job.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tenplex.runtime import netns
from tenplex.runtime.agent_hosts import TABLE, AgentJob, Hosts, reference_target
from tenplex.runtime.agent_run import AgentRun, AgentRunError
from tenplex.runtime.driver import DriverError, ScheduleDriver, refuse
from tenplex.runtime.durable_tier import newest_checkpoint
from tenplex.runtime.report import ledger, print_report
from tenplex.runtime.round_records import PARTS, downtimes, rounds, step_now, trained
from tenplex.runtime.runconfig import RunConfig
from tenplex.runtime.schedule import parse_schedule
from tenplex.train.config import TrainConfig

pytestmark = pytest.mark.dist

STEPS = 120  # enough that the job is still training when the last host joins, on a loaded machine too
SCHEDULE_STEPS = 132  # the schedule test's (a spare started after its host left has 36 steps to warm)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "elastic_charlm.py"
TOLERANCE = 1e-4  # fp32 round-off of other layouts (tp/pp/dp sums in another order), over the run


def _target(tmp: Path, job: str, pace: float, steps: int = STEPS) -> list[str]:
    return reference_target(tmp, job, pace, steps)


def _cli(hosts: Hosts, *args: str) -> subprocess.CompletedProcess:
    """`tenplex ARGS` on the rendezvous' host (inside the network: the job's addresses are there)."""
    return hosts.run("rdzv", [sys.executable, "-m", "tenplex.cli.main", *args])


def _static(tmp: Path, steps: int) -> dict[int, float]:
    """The losses of the same job on one host, no change (its LR schedule spans `steps`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    hosts = Hosts(tmp)
    job = AgentJob(hosts, "static", _target(tmp, "static", 0.0, steps), nodes="1")
    try:
        p = job.start("A")
        assert p.wait(120) == 0, (tmp / "agent-A.log").read_text()[-3000:]
    finally:
        job.close()
        hosts.close()
    return {s["step"]: s["loss"] for r in rounds(tmp / "out") for s in r["steps"]}


@pytest.fixture(scope="module")
def static(tmp_path_factory) -> dict[int, float]:
    return _static(tmp_path_factory.mktemp("static"), STEPS)


def _scenario(tmp: Path, network: str) -> dict:
    hosts = Hosts(tmp, network, gbps=1.0 if network == "netns" else None)
    job = AgentJob(hosts, "elastic", _target(tmp, "elastic", 0.4))
    out, seen = tmp / "out", {}
    try:
        a = job.start("A")
        job.wait("A to train alone", lambda: trained(out, 2) >= 4)
        job.start("B")
        job.wait("the 4-worker world to train", lambda: trained(out, 4) >= 3)
        seen["status"] = _cli(hosts, "status", "--rdzv-endpoint", job.endpoint, "--rdzv-id", "elastic")
        seen["b_url"] = job.store_url("B")
        seen["lost_at"] = job.lose("B")
        job.wait("A to recover alone", lambda: trained(out, 2, since=seen["lost_at"]) >= 3)
        # a new host joins, then leaves, each at the step the job asked for, not at the next step boundary:
        # a warm spare let in (`tenplex admit --at-step`), then SIGTERM once the job's change step is set
        # (`--at-step` on an ask that changes nothing: `auto` is the layout already)
        job.start("C", standby=True)
        job.wait("C's spare", lambda: job.waiting("C"))
        seen["join_at"] = step_now(out) + 15
        job.ask("admit", job.store_url("C"), at=seen["join_at"])
        job.wait("the 4-worker world again", lambda: step_now(out) > seen["join_at"] + 3)
        seen["leave_at"] = step_now(out) + 15
        job.ask("layout", "auto", at=seen["leave_at"])
        assert job.leave("C") == 0
        assert a.wait(150) == 0, (tmp / "agent-A.log").read_text()[-4000:]
    finally:
        job.close()
        hosts.close()
    return seen


# namespace hosts where they can be made (root), else loopback hosts: the same scenario, and one run of it
NETWORK = "loopback" if netns.unavailable() else "netns"


def test_agents_join_lose_a_host_rejoin_and_leave(tmp_path, static) -> None:
    network = NETWORK
    seen = _scenario(tmp_path, network)
    out = tmp_path / "out"
    status = seen["status"]
    assert (
        status.returncode == 0 and status.stdout.count(":7070" if network == "netns" else "127.0.0.1") >= 2
    ), status.stdout + status.stderr
    rs = [r for r in rounds(out) if r["ready"]]
    worlds = [r["ready"]["world"] for r in rs]
    assert worlds[0] == 2 and worlds.count(4) >= 2 and worlds[-1] == 2, worlds
    assert rs[0]["start"]["kind"] == "fresh"
    assert all(r["start"]["kind"] == "loaded" for r in rs[1:]), [r["start"]["kind"] for r in rs]
    recovered = next(r for r in rs if r["start"]["time"] > seen["lost_at"])
    # the changes planned at a step were handed ahead (forked and built while the round before trained: C's
    # join and leave; B joined at the next step boundary, no time to build ahead); after the loss, A's
    # workers were kept, the same processes, but for one that hung in the broken round's collective (gloo
    # cannot abort one): a fork took its slot
    i = rs.index(recovered)
    assert [bool(r["ready"].get("ahead")) for r in rs] == [False] * (len(rs) - 2) + [True, True], rs
    failed = [r for r in _records(tmp_path / "A") if r["kind"] == "worker_failed"]
    replaced = [r for r in failed if r["outcome"] != "error"]
    kept = set(recovered["ready"]["pids"]) & set(rs[i - 1]["ready"]["pids"])
    assert len(kept) == 2 - len(replaced), (recovered["ready"], rs[i - 1]["ready"], replaced)
    # the lost host was found at once (its store refused, or its address was unreachable), not after its
    # heartbeats lapsed: the next round formed without waiting for them
    found = [r for r in _records(tmp_path / "A") if r["kind"] == "found_lost"]
    assert [r["store"] for r in found] == [seen["b_url"]], found
    # the recovery after the loss names the lost store and loaded a snapshot no older than needed
    assert seen["b_url"] in recovered["start"]["lost_stores"], recovered["start"]
    # its shards came from their replica (`replaced`), unless the new layout needed none of them (dp2's
    # other replica on A holds the same state): either way nothing of B was read
    assert set(recovered["start"]["replaced"]) <= {seen["b_url"]}, recovered["start"]
    before = max(s["step"] for r in rs if r["start"]["time"] < seen["lost_at"] for s in r["steps"])
    assert recovered["start"]["step"] >= before - 4, (recovered["start"]["step"], before)
    assert rs[-1]["done"] and rs[-1]["done"]["step"] == STEPS
    # C joined and left at the steps asked for: the rounds before trained to them, the next loaded them
    assert [rs[-3]["steps"][-1]["step"], rs[-2]["steps"][-1]["step"]] == [seen["join_at"], seen["leave_at"]]
    assert [rs[-2]["start"]["step"], rs[-1]["start"]["step"]] == [seen["join_at"], seen["leave_at"]]
    check = ledger(out)  # every sample exactly once, a replayed step counted once
    assert check["ok"] and check["steps"] == STEPS, check
    losses = {s["step"]: s["loss"] for r in rs for s in r["steps"]}
    assert sorted(losses) == list(range(1, STEPS + 1))
    worst = max(abs(losses[k] - static[k]) for k in losses)
    assert worst <= TOLERANCE and math.isfinite(worst), worst
    recs = _records(tmp_path / "A")
    kinds = [r["kind"] for r in recs]
    assert "worker_failed" in kinds and kinds[-1] == "end", kinds
    assert [r["lost_stores"] for r in recs if r["kind"] == "round"][-1] == [seen["b_url"]]  # lost, C left
    print(
        network,
        "downtime per change:",
        [(d["world"], round(d["downtime"], 2)) for d in downtimes(out)],
        "worst loss difference",
        worst,
    )


def _trained_in(out: Path, layout: str) -> int:
    return sum(len(r["steps"]) for r in rounds(out) if r["ready"] and r["ready"]["layout"] == layout)


def _rounds_ready(out: Path) -> int:
    return sum(bool(r["ready"]) for r in rounds(out))


# the steps the changes are asked for, the last a stop: each ask comes 25 steps (7.5 s) ahead, once the round
# before it loaded (the command's start-up, a torch import, and the agent's look fit on a loaded machine)
AT = (25, 50, 75, 100)


def test_a_hosts_devices_and_the_layout_change_while_it_stays(tmp_path, static) -> None:
    """`tenplex devices` and `tenplex layout`, each a change without a change of the job's hosts, each at
    the step it names (`--at-step`): one host's devices go 0,1 -> 0,1,2,3 (two added), the layout is asked
    for at the same world (dp2-tp2 -> dp1-tp2-pp2), then the devices go to 1,3 (two removed, as when a
    device fails; the asked layout does not fit 2 ranks, so the table's is taken), then `tenplex stop`.
    Each round ends exactly at the step asked for and the next loads that step; with `--no-ahead` (as on
    accelerators) the workers of the devices that stay are the same processes throughout (a removed
    device's worker ends, an added one's is forked while the old round still trains); the losses equal
    the static run's, every sample is used once."""
    hosts = Hosts(tmp_path)
    job = AgentJob(hosts, "devs", _target(tmp_path, "devs", 0.3), nodes="1", extra=["--no-ahead"])
    out = tmp_path / "out"
    rdzv = ["--rdzv-endpoint", job.endpoint, "--rdzv-id", "devs"]

    def ask(at: int, *args: str) -> None:
        done = _cli(hosts, *args, *rdzv, "--at-step", str(at))
        assert done.returncode == 0 and f"after step {at}" in done.stdout, done.stdout + done.stderr

    try:
        a = job.start("A")
        url = job.store_url("A")
        asks = (["devices", url, "0,1,2,3"], ["layout", "tp=2,pp=2"], ["devices", url, "1,3"], ["stop"])
        for n, (at, args) in enumerate(zip(AT, asks, strict=True), 1):
            job.wait(f"round {n}", lambda n=n: _rounds_ready(out) >= n)
            ask(at, *args)
            if at == AT[1]:  # the round of 4 devices trains on until step 60
                status = json.loads(_cli(hosts, "status", *rdzv, "--json").stdout)
                assert status["at_step"] == at and status["agents"][0]["devices"] == [0, 1, 2, 3], status
        for args, words in ((["http://nowhere:1", "0"], "no agent at"), ([url, "0,0"], "named twice"),
                            ([url, "1,x"], "device indices"),
                            ([url, "0", "--at-step", "-1"], "non-negative")):  # fmt: skip
            bad = _cli(hosts, "devices", *args, *rdzv)
            assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        for args, words in ((["layout", "dp=x"], "malformed layout"), (["admit", url], "no spare waits"),
                            (["devices", url, "1,5", "--failed"], "name the devices that stay")):  # fmt: skip
            bad = _cli(hosts, *args, *rdzv)
            assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert a.wait(150) == 0, (tmp_path / "agent-A.log").read_text()[-4000:]
    finally:
        job.close()
        hosts.close()
    rs = [r for r in rounds(out) if r["ready"]]
    labels = [r["ready"]["layout"] for r in rs]
    assert labels == ["dp1-tp1-pp2", "dp2-tp2-pp1", "dp1-tp2-pp2", "dp1-tp1-pp2"], labels
    assert [r["start"]["kind"] for r in rs] == ["fresh", "loaded", "loaded", "loaded"]
    # each change landed at the step asked for: the round trained to it, and the next loaded it
    assert [r["steps"][-1]["step"] for r in rs] == list(AT), [r["steps"][-1] for r in rs]
    assert [r["start"]["step"] for r in rs[1:]] == list(AT[:-1])
    changes = [r for r in _records(tmp_path / "A") if r["kind"] == "change"]
    assert [c["at"] for c in changes] == list(AT[:-1]), changes
    assert _records(tmp_path / "A")[-1]["why"] == "stop"
    one, two, three, four = (r["ready"]["pids"] for r in rs)
    assert one[1] == two[1] == four[0] and two == three and two[3] == four[1], (one, two, three, four)
    assert len({*one, *two, *four}) == 4  # one process per device ever used
    formed = [r["devices"] for r in _records(tmp_path / "A") if r["kind"] == "round"]
    assert formed == [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [1, 3]], formed
    assert rs[-1]["done"]["step"] == AT[-1] and ledger(out)["ok"]
    losses = {s["step"]: s["loss"] for r in rs for s in r["steps"]}
    worst = max(abs(losses[k] - static[k]) for k in losses)
    assert sorted(losses) == list(range(1, AT[-1] + 1)) and worst <= TOLERANCE, worst
    for d in downtimes(out, tmp_path):
        print("devices, layout: world", d["world"], "downtime", round(d["downtime"], 2),
              {k: round(v, 2) for k, v in d["parts"].items()})  # fmt: skip


# a join, a host lost, a redeploy onto fresh hosts (every agent leaves, new ones join), each 24 steps (11 s)
# apart, a scale-out with a layout named 36 steps later (a spare for a host that joins again warms meanwhile:
# it starts once its host's old agent ended), a rank's device failed, and a scale-in by time (at the next
# step boundary)
def test_a_round_handed_ahead_is_cancelled_when_the_old_round_fails_first(tmp_path, static) -> None:
    """A planned change (a layout asked 30 steps ahead) forms its round early and hands it to workers
    forked ahead; then a worker of the old round dies before the change's step, so the old round never
    saves it and never gives the new one its turn: the round handed ahead is cancelled (its workers killed
    before they loaded anything), a round after it forms with the kept worker and a fork in the dead one's
    slot, and it loads the newest snapshot before the failure. The losses equal the static run's, every
    sample is used once."""
    hosts = Hosts(tmp_path)
    job = AgentJob(hosts, "cancel", _target(tmp_path, "cancel", 0.2), nodes="1")
    out = tmp_path / "out"
    try:
        a = job.start("A")
        job.wait("round 1 to train", lambda: step_now(out) >= 5)
        at = step_now(out) + 30  # the next round forms AHEAD_LEAD_S before it, handed ahead
        job.ask("layout", "tp=2", at=at)
        formed = lambda: [r["round"] for r in _records(tmp_path / "A") if r["kind"] == "round"]  # noqa: E731
        job.wait("the round handed ahead", lambda: formed() == [1, 2])
        died = step_now(out)
        assert died < at - 3, (died, at)
        os.kill(rounds(out)[0]["ready"]["pids"][1], signal.SIGKILL)
        assert a.wait(150) == 0, (tmp_path / "agent-A.log").read_text()[-4000:]
    finally:
        job.close()
        hosts.close()
    recs = _records(tmp_path / "A")
    cancelled = [r for r in recs if r["kind"] == "change" and r["round"] == 2]
    assert cancelled and "failed before its final save" in cancelled[0]["why"], recs
    assert [r["round"] for r in recs if r["kind"] == "round"] == [1, 2, 3]
    rs = [r for r in rounds(out) if r["ready"]]
    assert [(r["round"], r["ready"]["world"], bool(r["ready"].get("ahead"))) for r in rs] == [
        (1, 2, False), (3, 2, False)
    ], [r["ready"] for r in rs]  # fmt: skip
    assert rs[1]["start"]["kind"] == "loaded" and died - 4 <= rs[1]["start"]["step"] <= died + 1
    assert rs[1]["ready"]["layout"] == "dp1-tp2-pp1"  # the layout asked, taken by the round after
    assert rs[-1]["done"]["step"] == STEPS and ledger(out)["ok"]
    losses = {s["step"]: s["loss"] for r in rs for s in r["steps"]}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert max(abs(losses[k] - static[k]) for k in losses) <= TOLERANCE


SCHEDULE = [
    {"step": 0, "devices": 2},
    {"step": 24, "devices": 4},
    {"step": 48, "fail_hosts": ["h1"]},
    {"step": 72, "redeploy": True},
    {"step": 108, "devices": 4, "layout": {"dp": 1, "tp": 2, "pp": 2}},
    {"step": 120, "fail": [3]},
    {"time": 0, "devices": 2},  # at once once the failure's round loaded: at the next step boundary
]


def test_a_schedule_played_on_agents(tmp_path) -> None:
    """`tenplex run`'s resource schedule played on agents (`runtime/agent_run.py`, `runtime/driver.py`): each
    planned change lands at its step (the round trains to it, the next loads it), the lost host's shards
    come from their replica, the redeploy's new hosts load from the old hosts' stores (kept until the new
    round loaded), the failed device's rank is gone from the next round; the losses equal the static
    run's and every sample is used once; the run's timeline, summary and plot are `tenplex run`'s. A
    partition on loopback hosts is refused before anything starts."""
    with pytest.raises(DriverError, match="a partition needs namespace hosts"):
        refuse(parse_schedule([{"step": 0, "devices": 2}, {"step": 5, "partition": ["h0"]}]), False)
    static = _static(tmp_path / "static", SCHEDULE_STEPS)
    train = TrainConfig(model="tiny", global_batch=12, steps=SCHEDULE_STEPS)  # as `reference_target`'s
    cfg = RunConfig(train, parse_schedule(SCHEDULE), SCHEDULE_STEPS, tmp_path, job="sched", snapshot_every=2,
                    table=TABLE, quiet=True)  # fmt: skip
    run = AgentRun(cfg, pace=0.45)
    s = run.run()
    job, driver, out = run.job, run.driver, tmp_path
    assert job is not None and driver is not None
    planned = [(x["step"], x["landed"]) for x in driver.log if "fail" not in x["event"] and x["step"]]
    assert planned == [(24, 24), (72, 72), (108, 108)], driver.log
    rs = [r for r in rounds(out) if r["ready"]]
    assert [r["ready"]["world"] for r in rs] == [2, 4, 2, 2, 4, 3, 2], [r["ready"] for r in rs]
    assert rs[4]["ready"]["layout"] == "dp1-tp2-pp2"
    assert rs[0]["start"]["kind"] == "fresh" and all(r["start"]["kind"] == "loaded" for r in rs[1:])
    # handed ahead: the changes planned at a step (the join, the redeploy, whose new hosts loaded once the old
    # ones closed their round, the scale-out); not the recoveries, nor the scale-in by time (at the next step
    # boundary: no time to build ahead)
    assert [bool(r["ready"].get("ahead")) for r in rs] == [False, True, False, True, True, False, False]
    assert job.store_url("h1") in rs[2]["start"]["lost_stores"], rs[2]["start"]
    # the fresh hosts' agents never saw h1 lost, yet their rounds' loads count its store lost unasked
    formed = [r for r in _records(tmp_path / "h2") if r["kind"] == "round"]
    assert all(job.store_url("h1") in r["retired"] for r in formed), formed
    assert rs[2]["start"]["step"] >= 44  # the newest snapshot before the loss, from h1's replica on h0
    pids = [set(r["ready"]["pids"]) for r in rs]
    assert not pids[4] & pids[1] and not pids[4] & pids[3]  # forked ahead on the fresh hosts
    assert rs[-1]["done"]["step"] == SCHEDULE_STEPS and ledger(out)["ok"]
    losses = {s["step"]: s["loss"] for r in rs for s in r["steps"]}
    worst = max(abs(losses[k] - static[k]) for k in losses)
    assert sorted(losses) == list(range(1, SCHEDULE_STEPS + 1)) and worst <= TOLERANCE, worst
    # the job told in `tenplex run`'s words: what its report, summary and plot read
    assert json.loads((tmp_path / "summary.json").read_text())["ledger"] == s["ledger"]
    assert (tmp_path / "timeline.png").exists()
    kinds = [(r["change"], r["step"]) for r in s["reconfigurations"]]
    assert [k for k, _ in kinds] == [
        "scale out 2 → 4", "failure", "redeploy", "scale out 2 → 4", "failure", "scale in 3 → 2"
    ], kinds  # fmt: skip
    assert [kinds[i][1] for i in (0, 2, 3)] == [24, 72, 108], kinds
    lost = [(f["hosts"], f["devices"]) for f in s["failures"]]
    assert lost[0][0] == ["h1"] and len(lost[1][1]) == 1 and not lost[1][0], lost
    assert [r["step"] for r in s["recoveries"]] == [rs[2]["start"]["step"], rs[-2]["start"]["step"]]
    assert s["ledger"]["ok"] and s["losses"] == losses and s["steps"] == SCHEDULE_STEPS
    assert all(set(r["parts"]) == set(PARTS) and r["downtime"] > 0 for r in s["reconfigurations"])
    print_report(s)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "agent.jsonl").read_text().splitlines()]


def test_every_host_lost_resumes_from_the_persisted_checkpoint(tmp_path, static) -> None:
    """`--persist-every 1`: node 0's agent writes each snapshot it sees as a DCP checkpoint. When every
    host is lost at once (agent, workers and store killed: no replica survives), an agent on a new host
    resumes from the newest checkpoint, not from step 0, and the losses after it equal the static run's."""
    hosts = Hosts(tmp_path)
    durable = tmp_path / "durable"
    flags = ["--persist-every", "1", "--persist-dir", str(durable)]
    job = AgentJob(hosts, "kept", _target(tmp_path, "kept", 0.05), nodes="1", extra=flags)
    out = tmp_path / "out"
    try:
        job.start("A")
        started = tmp_path / "A" / "agent.jsonl"
        persists = lambda: started.exists() and sum(r["kind"] == "persist" for r in _records(started.parent))  # noqa: E731
        job.wait("two checkpoints", lambda: persists() >= 2)
        job.lose("A")
        found = newest_checkpoint(durable)
        assert found is not None
        assert job.start("B").wait(240) == 0, (tmp_path / "agent-B.log").read_text()[-4000:]
    finally:
        job.close()
        hosts.close()
    rs = [r for r in rounds(out) if r["ready"]]
    resumed = rs[-1]["start"]
    assert resumed["kind"] == "loaded" and resumed["source"] == "durable", resumed
    assert resumed["step"] == found[1] > 0, (resumed, found)
    assert rs[-1]["done"]["step"] == STEPS
    worst = max(abs(s["loss"] - static[s["step"]]) for s in rs[-1]["steps"])
    assert worst <= TOLERANCE, worst


def test_agent_refuses_bad_input_in_one_line(tmp_path) -> None:
    hosts = Hosts(tmp_path)
    for args, words in (
        (["--nnodes", "3:2"], "MIN"),
        (["--nnodes", "x"], "--nnodes 'x'"),
        (["--nproc-per-node", "0"], "nproc"),
        (["--rdzv-conf", "oops"], "key=value"),
        (["--store", "http://127.0.0.1:9"], "no store answers"),
    ):
        p = _cli(hosts, "agent", "--run-dir", str(tmp_path / "r"), *args, "train.py")
        assert p.returncode == 2 and words in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_a_spare_never_let_in_leaves_without_joining(tmp_path) -> None:
    """A warm spare (`--standby`) waits, warm, outside the rendezvous; told to leave (SIGTERM) before it
    was let in, it ends cleanly, never having formed a round, and says so in its records; `tenplex
    status` lists it while it waits."""
    hosts = Hosts(tmp_path)
    job = AgentJob(hosts, "spare", _target(tmp_path, "spare", 0.0), nodes="1")
    try:
        job.start("A", standby=True)
        job.wait("the spare", lambda: job.waiting("A"))
        shown = _cli(hosts, "status", "--rdzv-endpoint", job.endpoint, "--rdzv-id", "spare", "--json")
        assert json.loads(shown.stdout)["spares"] == [job.store_url("A")], shown
        assert job.leave("A") == 0
    finally:
        job.close()
        hosts.close()
    kinds = [r["kind"] for r in _records(tmp_path / "A")]
    assert kinds == ["store", "warm", "standby"], kinds


def test_a_job_that_ends_before_its_schedule_does_ends_cleanly(tmp_path) -> None:
    """`AgentRun`: the job trains its last step (8) before the schedule's next event (step 20) comes:
    that event never lands (the driver's log says so), the agents end well, a leaving host does not
    linger, and the run's summary has its one round and an exact ledger. A script, and settings the
    agents have no counterpart for, are refused in one line (not on agents yet)."""
    train = TrainConfig(model="tiny", global_batch=12, steps=8)
    schedule = parse_schedule([{"step": 0, "devices": 2}, {"step": 20, "devices": 4}])
    with pytest.raises(AgentRunError, match="a script's run on agents is not there yet"):
        AgentRun(RunConfig(train, schedule, 8, tmp_path / "s", script=[str(EXAMPLE)]))
    with pytest.raises(AgentRunError, match="not on agents yet: --nic-latency-ms, --fresh"):
        AgentRun(RunConfig(train, schedule, 8, tmp_path / "s", nic_latency_ms=5.0, fresh=True))
    run = AgentRun(RunConfig(train, schedule, 8, tmp_path, job="short", snapshot_every=2, quiet=True))
    t = time.monotonic()
    s = run.run()
    assert run.driver is not None and run.driver.log == [
        {"event": "step 20: 4 devices", "step": 20, "landed": None}
    ]
    assert s["steps"] == 8 and s["ledger"]["ok"] and not s["reconfigurations"], s
    assert time.monotonic() - t < 90  # nothing waited for a change that never came


def test_a_host_cut_off_is_dropped_and_the_job_goes_on(tmp_path) -> None:
    """Namespace hosts: h1's link goes down mid-round (a partition in the schedule, played by the driver:
    no error reaches anyone, a collective with it would wait forever). h0's agent hears nothing from
    h1's, ends the round, restarts the workers stuck in it, and the job goes on alone from the newest
    snapshot, h1's store counted lost."""
    if netns.unavailable():
        pytest.skip(netns.unavailable() or "")
    hosts = Hosts(tmp_path, "netns", gbps=1.0)
    job = AgentJob(hosts, "cut", _target(tmp_path, "cut", 0.3, steps=60))
    out = tmp_path / "out"
    driver = ScheduleDriver(
        job, parse_schedule([{"step": 0, "devices": 4}, {"step": 6, "partition": ["h1"]}]), out
    )
    try:
        driver.start()
        b_url = job.store_url("h1")
        driver.follow()
        assert job.agents["h0"].wait(240) == 0, (tmp_path / "agent-h0.log").read_text()[-4000:]
    finally:
        job.close()
        hosts.close()
    rs = [r for r in rounds(out) if r["ready"]]
    assert [r["ready"]["world"] for r in rs] == [4, 2], [r["ready"] for r in rs]
    assert rs[1]["start"]["kind"] == "loaded" and b_url in rs[1]["start"]["lost_stores"], rs[1]["start"]
    assert rs[-1]["done"]["step"] == 60 and ledger(out)["ok"]
    changes = [r for r in _records(tmp_path / "h0") if r["kind"] == "change"]
    assert any("fell silent" in c["why"] for c in changes), changes
    print("cut off: downtime", [(d["world"], round(d["downtime"], 2)) for d in downtimes(out)])


def _charlm(steps: int, pace: float) -> list[str]:
    flags = {
        "--job": "charlm",
        "--steps": steps,
        "--global-batch": 24,
        "--out": "out",
        "--min-step-seconds": pace,
    }
    return [str(EXAMPLE), *(str(x) for kv in flags.items() for x in kv)]


def test_a_users_fsdp2_script_under_agents(tmp_path) -> None:
    """examples/elastic_charlm.py (FSDP2 over every rank, the exactly-once sampler) through a join, an agent
    restarted on its host (its store survives and is attached again), a lost host and `tenplex stop`;
    then the same steps on one host: equal losses, every sample once."""
    hosts = Hosts(tmp_path)
    job = AgentJob(hosts, "charlm", _charlm(100_000, 0.05))
    out = tmp_path / "out"
    try:
        a = job.start("A")
        job.wait("A alone", lambda: trained(out, 2) >= 20)
        job.start("B")
        job.wait("world 4", lambda: trained(out, 4) >= 20)
        store_pid, restarted = job.store_pid("B"), time.time()
        job.agents.pop("B").kill()  # the agent alone dies (its workers with it); its store stays
        job.start("B")
        job.wait("world 4 again", lambda: trained(out, 4, since=restarted) >= 20)
        assert job.store_pid("B") == store_pid  # the same store, attached again
        lost = job.lose("B")
        job.wait("world 2 after the loss", lambda: trained(out, 2, since=lost) >= 20)
        stop = _cli(hosts, "stop", "--rdzv-endpoint", job.endpoint, "--rdzv-id", "charlm")
        assert stop.returncode == 0, stop.stderr
        assert a.wait(60) == 0  # the workers saved at their next step; the agent ended
    finally:
        job.close()
        hosts.close()
    rs = [r for r in rounds(out) if r["ready"]]
    assert [r["start"]["kind"] for r in rs] == ["fresh"] + ["loaded"] * (len(rs) - 1)
    last = rs[-1]["done"]["step"]
    losses = {s["step"]: s["loss"] for r in rs for s in r["steps"]}
    check = ledger(out)
    assert check["ok"] and check["steps"] == last, check
    static_dir = tmp_path / "static"
    static_dir.mkdir()
    one, solo = Hosts(static_dir), None
    try:
        solo = AgentJob(one, "charlm-static", _charlm(last, 0.0), nodes="1")
        assert solo.start("A").wait(300) == 0
    finally:
        if solo is not None:
            solo.close()
        one.close()
    static = {s["step"]: s["loss"] for r in rounds(static_dir / "out") for s in r["steps"]}
    worst = max(abs(losses[k] - static[k]) for k in range(1, last + 1))
    assert worst <= TOLERANCE, worst
    attached = [r for r in _records(tmp_path / "B") if r["kind"] == "store"]
    assert [r["attached"] for r in attached] == [False, True], attached
    assert _records(tmp_path / "A")[-1]["why"] == "stop"
    print(
        "charlm: downtime per change",
        [(d["world"], round(d["downtime"], 2)) for d in downtimes(out)],
        "worst loss difference",
        worst,
    )


def test_a_script_that_keeps_failing_ends_the_job_after_max_restarts(tmp_path) -> None:
    """A script that raises in every round is restarted in place --max-restarts times, then the agent
    ends with exit 1, the error in its records and the worker's log (no endless loop)."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import tenplex\n\ntenplex.ElasticJob('broken', until=5)\nraise ValueError('bad batch')\n"
    )
    hosts = Hosts(tmp_path)
    job = AgentJob(hosts, "broken", [str(script)], nodes="1", nproc=1, extra=["--max-restarts", "2"])
    try:
        assert job.start("A").wait(120) == 1
    finally:
        job.close()
        hosts.close()
    recs = _records(tmp_path / "A")
    failed = [r for r in recs if r["kind"] == "worker_failed"]
    assert len(failed) == 3 and all("ValueError: bad batch" in r["error"] for r in failed), failed
    assert recs[-1]["kind"] == "end" and recs[-1]["why"] == "max_restarts"
    assert "ValueError: bad batch" in Path(failed[0]["log"]).read_text()
