"""The elastic runtime: schedules, the layout chooser, and whole jobs under changes and failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outputs import first_crash
from tenplex.ptc import PRESETS, PTCError, preset
from tenplex.ptc.layout import Layout
from tenplex.runtime.chooser import (
    ChooserError,
    calibration,
    calibration_rows,
    candidates,
    choose,
    parse_table,
    self_check,
)
from tenplex.runtime.hosts import health
from tenplex.runtime.schedule import ScheduleError, parse_schedule
from tenplex.store.process import logged_stores
from tenplex.transformer.snapshot import newest_step

# -- schedule ---------------------------------------------------------------------------------------------


def test_schedule_parses_every_kind_of_event():
    events = parse_schedule(
        [
            {"step": 0, "devices": 2},
            {"step": 10, "devices": 4, "layout": {"tp": 2, "pp": 2}},
            {"step": 20, "redeploy": True},
            {"step": 25, "hosts": ["h0"]},
            {"step": 30, "fail": [1]},
            {"step": 31, "fail_hosts": ["h3"]},
            {"time": 60.5, "devices": 1},
        ]
    )
    assert events[1].layout == {"tp": 2, "pp": 2} and events[2].redeploy and events[4].is_failure
    assert events[6].time == 60.5 and "fail ranks [1]" in events[4].describe()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "non-empty list"),
        ([{"step": 3, "devices": 2}], "first event must be at step 0"),
        ([{"step": 0}], "first event must be at step 0 (or time 0) and say how many devices"),
        ([{"step": 0, "devices": 0}], "devices must be a positive integer"),
        ([{"step": 0, "devices": 2, "time": 1}], "exactly one of 'step' or 'time'"),
        ([{"step": 0, "devices": 2}, {"time": 5, "fail_hosts": ["h0"]}], "failures are injected at a step"),
        ([{"step": 0, "devices": 2}, {"step": -1}], "non-negative integer"),
        ([{"step": 0, "devices": 2}, {"step": 5, "fail": "1"}], "fail must be a list of ranks"),
        ([{"step": 0, "devices": 2}, {"step": 5, "gpus": 3}], "unknown keys ['gpus']"),
        ([{"step": 0, "devices": 2}, {"step": 5, "layout": {"dp": 0}}], "layout must look like"),
        ([{"step": 0, "devices": 2}, {"step": 9}, {"step": 5}], "comes before the previous one"),
        ([{"step": 0, "devices": 2}, {"step": True}], "step must be a non-negative integer, got True"),
        ([{"step": 0, "devices": 2}, {"step": 5, "layout": {"dp": 1, "ep": 2}}], "layout must look like"),
        ([{"step": 0, "devices": 2}, {"step": 5, "hosts": ["h0", ""]}], "hosts must be a list of host names"),
        ([{"step": 0, "devices": 2}, {"step": 5, "redeploy": "yes"}], "redeploy must be true or false"),
        ([{"step": 0, "devices": 2}, [5]], "schedule event 1 must be a mapping, got [5]"),
        ([{"step": 0, "devices": 2}, {"time": 5.5, "devices": 1.5}], "devices must be a positive integer"),
    ],
)
def test_schedule_errors_are_clear(data, message):
    with pytest.raises(
        ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        parse_schedule(data)


def test_tables_are_read_from_json_or_yaml_with_one_line_errors(tmp_path):
    from tenplex.runtime.schedule import load_schedule
    from tenplex.runtime.tables import TableError, read_table

    (tmp_path / "t.yaml").write_text("4: {dp: 2, tp: 2}\n")
    (tmp_path / "t.json").write_text('{"4": {"dp": 2, "tp": 2}}')
    assert read_table(tmp_path / "t.yaml", "para-config") == {4: {"dp": 2, "tp": 2}}
    assert parse_table(read_table(tmp_path / "t.json")) == parse_table(read_table(tmp_path / "t.yaml"))
    (tmp_path / "bad.json").write_text("{4: ")
    with pytest.raises(TableError, match=r"para-config .*bad\.json' is not valid JSON"):
        read_table(tmp_path / "bad.json", "para-config")
    with pytest.raises(TableError, match=r"cannot read table .*none\.yaml"):
        read_table(tmp_path / "none.yaml")
    (tmp_path / "bad.yaml").write_text("- {step: 0\n")
    with pytest.raises(ScheduleError, match=r"schedule .*bad\.yaml' is not valid YAML"):
        load_schedule(tmp_path / "bad.yaml")


# -- chooser ----------------------------------------------------------------------------------------------


@given(
    st.sampled_from(sorted(PRESETS)),
    st.integers(1, 64),
    st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128, 512]),
)
@settings(max_examples=200, deadline=None)
def test_chooser_never_proposes_an_invalid_layout(model, devices, global_batch):
    cfg = preset(model)
    for lay in candidates(cfg, devices, global_batch):
        assert lay.world == devices
        assert cfg.heads % lay.tp == 0 and cfg.layers % lay.pp == 0 and global_batch % lay.dp == 0
    try:
        best = choose(model, devices, global_batch)
    except ChooserError:  # no candidate the reference workload runs
        for lay in candidates(cfg, devices, global_batch):
            with pytest.raises(PTCError):
                lay.check(cfg, devices)
        return
    assert best in candidates(cfg, devices, global_batch)
    best.check(cfg, devices)  # and one the reference workload runs (tied embeddings: tp = pp = 1)


def test_chooser_respects_device_memory():
    cfg = preset("gpt3-13b")
    roomy = candidates(cfg, 8, 64, micro_batch=1)
    tight = candidates(cfg, 8, 64, micro_batch=1, device_memory=40 * 2**30)
    assert tight and len(tight) < len(roomy)
    assert all(lay.tp * lay.pp >= 4 for lay in tight)  # 13B x 16 B of state must be split at least 4 ways


def test_top_choice_is_within_ten_percent_of_the_best_measured_layout():
    """On the calibration benchmark, leave-one-out: each (model, devices) picked by a model fitted to the
    other groups' rows, its measured time against the measured best."""
    checks = self_check(calibration_rows(calibration()), calibration()["cores"])
    assert len(checks) >= 4
    for c in checks:
        assert c["ratio"] <= 1.10, c


def test_tenplex_choose_reports_the_layout_the_runtime_takes(capsys):
    from tenplex.cli.main import main

    # gpt3-125m on 8 devices, batch 8: the model ranks dp4-tp2 first, which tied embeddings rule out
    assert main(["choose", "--model", "gpt3-125m", "--devices", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    first = out["ranking"][0]
    assert (first["dp"], first["tp"]) == (4, 2)
    assert Layout(out["choice"]["dp"], out["choice"]["tp"], out["choice"]["pp"]) == choose("gpt3-125m", 8, 8)


def test_para_config_overrides_and_is_validated():
    table = {"4": {"dp_size": 1, "mp_size": 2, "pp_size": 2}}
    assert choose("tiny", 4, 8, table=table) == Layout(1, 2, 2)
    with pytest.raises(ChooserError, match="dp\\*tp\\*pp = 2, not 4"):
        parse_table({"4": {"dp": 2}})


# -- placing ranks ----------------------------------------------------------------------------------------


def test_each_rank_starts_where_its_state_lies():
    from tenplex.runtime.placement import Placed, match
    from tenplex.train.config import TrainConfig

    ptc_of = TrainConfig(model="tiny").state_ptc
    hosts = [[f"h{h}/d0", f"h{h}/d1"] for h in range(4)]
    every = [d for h in hosts for d in h]
    assert match(None, Layout(2, 2, 2), every, [], ptc_of) == every  # nothing to load: allocation order
    assert (
        match(Placed(Layout(1, 2, 2), tuple(hosts[0] + hosts[1])), Layout(2, 2, 2), every, [], None) == every
    )
    prev = Placed(Layout(1, 2, 2), tuple(hosts[0] + hosts[1]))  # stage 0 on h0, stage 1 on h1
    # (pp, dp, tp) rank order: stage 1's first replica (ranks 4, 5) stays on h1's devices; numbering
    # would have sent it to h2 and moved both stages across hosts
    assert match(prev, Layout(2, 2, 2), every, [], ptc_of) == hosts[0] + hosts[2] + hosts[1] + hosts[3]
    # h1 is gone: its stage comes from elsewhere, the rest stays put
    assert match(prev, Layout(1, 2, 2), hosts[0] + hosts[2], ["h1"], ptc_of)[:2] == hosts[0]


def test_placement_says_why_it_cannot_match():
    from tenplex.runtime.placement import MatchSkipped, Placed, match
    from tenplex.train.config import TrainConfig

    ptc_of = TrainConfig(model="tiny").state_ptc
    with pytest.raises(MatchSkipped, match="heads"):  # tiny has 4 heads
        match(Placed(Layout(1, 1, 1), ("h0/d0",)), Layout(1, 3, 1), ["h0/d0", "h0/d1", "h1/d0"], [], ptc_of)


# -- local ranks ------------------------------------------------------------------------------------------


def test_local_ranks_get_their_place_and_failures_are_reported_with_output():
    from tenplex.util.ranks import RanksFailed, run_local

    show = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['X'])"
    logs = run_local([sys.executable, "-c", show], 2, env=dict(os.environ, X="a"),
                     per_rank_env=[{"X": "b"}, {}], capture=True)  # fmt: skip
    assert [line.strip() for line in logs] == ["0 2 b", "1 2 a"]
    fail = "import os, sys; print('rank', os.environ['RANK']); sys.exit(int(os.environ['RANK']) * 3)"
    with pytest.raises(RanksFailed) as e:
        run_local([sys.executable, "-c", fail], 2, env=dict(os.environ), capture=True)
    assert e.value.failed == [(1, 3)] and e.value.logs[1].strip() == "rank 1"
    with pytest.raises(RanksFailed) as e:  # an abort shows where it happened, as the first crash
        run_local([sys.executable, "-c", "import os\ndef f():\n    os.abort()\nf()"], 1, env=dict(os.environ),
                  capture=True)  # fmt: skip
    assert e.value.failed == [(0, -6)] and "Fatal Python error: Aborted" in e.value.logs[0]
    assert "line 3 in f" in first_crash(e.value.logs[0])
    t = time.time()
    with pytest.raises(RanksFailed):  # past the timeout: killed, not left behind
        run_local([sys.executable, "-c", "import time; time.sleep(60)"], 1, env=dict(os.environ), timeout=1)
    assert time.time() - t < 30


# -- downtime ---------------------------------------------------------------------------------------------


def test_downtime_is_split_into_named_parts_that_add_up():
    from tenplex.runtime.downtime import PARTS, reconfiguration
    from tenplex.runtime.phase import Phase

    old = Phase(0, Layout(2), ["h0/d0", "h0/d1"], 0, 10, launched=90.0, ended=103.0, persist_seconds=0.25)
    for r in [
        {"kind": "step", "step": 10, "time": 100.0},
        {"kind": "saved", "step": 10, "seconds": 1.5, "time": 102.0},
        {"kind": "done", "step": 10, "time": 102.1},
    ]:
        old.add(r)
    new = Phase(1, Layout(1, 2, 2), ["h0/d0", "h0/d1", "h1/d0", "h1/d1"], 10, 20)
    for r in [
        {"kind": "loaded", "step": 10, "seconds": 0.5, "time": 104.9, "bytes": {"cross_host": 8},
         "plan": {"cross_host_lower_bound": 8}, "source": "memory"},
        {"kind": "ready", "step": 10, "time": 105.0, "init_at": 103.5, "process_group_seconds": 0.3},
    ]:  # fmt: skip
        new.add(r)
    assert reconfiguration(old, new) is None  # reported at the new phase's first step
    new.add({"kind": "step", "step": 11, "time": 105.75})
    info = reconfiguration(old, new)
    p = info["parts"]
    assert info["downtime"] == pytest.approx(5.75) and sum(p.values()) == pytest.approx(5.75)
    expected = {"stop": 0.5, "save": 1.5, "go": 0.0, "exit": 1.0, "persist": 0.25, "start": 0.25,
                "process_group": 0.3, "build": 0.7, "load": 0.5, "first_step": 0.75,
                "other": 0.0}  # fmt: skip
    assert set(p) == {*PARTS, "other"} and p == pytest.approx(expected)
    assert (info["from"], info["to"], info["failure"], info["redeploy"]) == (
        "dp2-tp1-pp1",
        "dp1-tp2-pp2",
        False,
        False,
    )
    old.failed_at = 101.0  # a failure: no save; the downtime runs from the failure
    failed = reconfiguration(old, new)
    assert failed["downtime"] == pytest.approx(4.75) and failed["parts"]["save"] == 0.0
    assert failed["parts"]["exit"] == pytest.approx(2.0) and failed["failure"]

    old.failed_at = None  # started ahead: built before the save, told to go 0.25 s after its commit
    ahead = Phase(1, Layout(1, 2, 2), new.devices, 10, 20)
    for r in [
        {"kind": "waiting", "seconds": 3.0, "time": 96.0},
        {"kind": "loaded", "step": 10, "seconds": 0.5, "time": 102.8, "bytes": {}, "plan": {},
         "source": "memory"},
        {"kind": "ready", "step": 10, "time": 102.9, "init_at": 93.0, "process_group_seconds": 0.3,
         "ahead": True, "go_at": 102.25},
        {"kind": "step", "step": 11, "time": 103.0},
    ]:  # fmt: skip
        ahead.add(r)
    info = reconfiguration(old, ahead)
    expected = {"stop": 0.5, "save": 1.5, "go": 0.25, "exit": 0.0, "persist": 0.0, "start": 0.0,
                "process_group": 0.0, "build": 0.15, "load": 0.5, "first_step": 0.1,
                "other": 0.0}  # fmt: skip
    assert info["downtime"] == pytest.approx(3.0) and info["parts"] == pytest.approx(expected)
    # the go file is written right before the old phase's `saved` record: no negative go, build from there
    ahead.records[2]["go_at"] = 101.99
    early = reconfiguration(old, ahead)["parts"]
    assert early == pytest.approx({**expected, "go": 0.0, "build": 0.4})


def test_a_preview_of_the_allocation_is_what_applying_the_events_makes_and_changes_nothing(tmp_path):
    """A phase started ahead is planned on `preview`; the boundary then applies the same events."""
    from tenplex.runtime.hosts import EmulatedHosts, HostsError
    from tenplex.runtime.schedule import Event

    hosts = EmulatedHosts(tmp_path, devices_per_host=2, failed_devices={"h0/d1"})
    hosts.allocation = ["h0/d0", "h1/d0", "h1/d1"]
    cases = [[Event(step=5, devices=4)], [Event(step=5, redeploy=True)], [Event(step=5, devices=1)],
             [Event(step=5, devices=2), Event(step=5, hosts=("h1", "h2"))]]  # fmt: skip
    for events in cases:
        seen = hosts.preview(events)
        assert hosts.allocation == ["h0/d0", "h1/d0", "h1/d1"] and not (tmp_path / "cluster.json").exists()
        twin = EmulatedHosts(tmp_path / "twin", devices_per_host=2, failed_devices={"h0/d1"})
        twin.allocation = list(hosts.allocation)
        (tmp_path / "twin").mkdir(exist_ok=True)
        for e in events:
            twin.apply(e)
        assert seen == twin.allocation, events
    with pytest.raises(HostsError, match="needs 40 devices"):
        hosts.preview([Event(step=5, devices=40)])
    assert hosts.allocation == ["h0/d0", "h1/d0", "h1/d1"]


# -- the worker spec and the stores' identity ------------------------------------------------------------


def test_the_worker_spec_round_trips_with_each_ranks_placement(tmp_path):
    from tenplex.runtime.spec import SpecError, WorkerSpec

    spec = WorkerSpec(
        "j",
        12,
        snapshot_every=3,
        out="o",
        layout=Layout(2, 1, 2, True),
        train={"model": "tiny"},
        failures=[7],
        control="127.0.0.1:5",
        phase=3,
    )
    path = spec.to_file(tmp_path / "spec.json")
    placed = WorkerSpec(**{**spec.__dict__, "store": "http://s:1", "device": "h1/d0", "sources": ["a", "b"]})
    env = placed.rank_env(path)
    assert "store" not in json.loads(path.read_text())  # one file serves every rank of the phase
    back = WorkerSpec.from_env(env)
    assert back == WorkerSpec(**{**placed.__dict__, "emulated_hosts": False})
    assert back.layout == Layout(2, 1, 2, True) and WorkerSpec.from_env({}) is None
    assert back.failures == [7] and (back.control, back.phase) == ("127.0.0.1:5", 3)
    (tmp_path / "bad.json").write_text('{"job": "j", "until": 1, "choose": true}')
    with pytest.raises(SpecError, match="unknown keys \\['choose'\\]"):
        WorkerSpec.from_file(tmp_path / "bad.json")
    with pytest.raises(SpecError, match="cannot read"):
        WorkerSpec.from_env({"TENPLEX_WORKER_SPEC": str(tmp_path / "none.json")})


def test_a_recorded_store_pid_is_signalled_only_while_it_is_that_store(tmp_path):
    from tenplex.runtime.hosts import EmulatedHosts, is_store, started_at

    hosts = EmulatedHosts(tmp_path)
    url = hosts.store_url("h0")
    real = hosts.stores["h0"]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert is_store(real)
        # the PID now belongs to another process (reused), or to one started at another time
        assert not is_store({"url": url, "pid": other.pid, "since": started_at(other.pid)})
        assert not is_store({**real, "since": real["since"] + 1})
        hosts.stores["h1"] = {"url": url, "pid": other.pid, "since": started_at(other.pid)}
        hosts.save()
        again = EmulatedHosts(tmp_path)
        assert again.restore() and set(again.stores) == {"h0"}  # the impostor is not taken back
        hosts.shutdown()  # signals the store, not the process that took a recorded PID
        assert other.poll() is None
        deadline = time.time() + 10
        while health(url) and time.time() < deadline:
            time.sleep(0.1)
        assert health(url) is None
    finally:
        other.kill()
        other.wait()


def test_the_stores_of_spare_hosts_run_before_the_job_needs_them_and_never_outlive_a_shutdown(tmp_path):
    """A redeploy or a scale-out should not wait for its hosts' stores to start: `fill` starts those of the
    job's hosts and of the next unused ones (enough for the largest layout) in a thread, never on a failed
    host; once the hosts are shut down, a late start is refused rather than leaving a store behind."""
    from tenplex.runtime.channel import Channel
    from tenplex.runtime.hosts import EmulatedHosts
    from tenplex.runtime.launcher import Launcher

    hosts = EmulatedHosts(tmp_path, devices_per_host=2, failed_hosts={"h1"})
    hosts.allocation = ["h0/d0", "h0/d1"]
    launcher = Launcher(tmp_path, hosts, pool_size=4, channel=Channel("127.0.0.1"))
    try:
        assert launcher.spare_hosts() == {"h0": 2, "h2": 2, "h3": 2}
        launcher.start_stores(list(launcher.spare_hosts()))
        launcher.close()  # waits for the thread
        assert set(hosts.stores) == {"h0", "h2", "h3"}
        urls = [s["url"] for s in hosts.stores.values()]
        assert all(health(u) for u in urls)
        hosts.shutdown()
        launcher.start_stores(["h4"])
        launcher.close()
        assert hosts.stores == {} and not (tmp_path / "store-h4.log").exists()
        deadline = time.time() + 10
        while any(health(u) for u in urls) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(health(u) for u in urls)
    finally:
        launcher.close()
        hosts.shutdown()


# -- whole jobs -------------------------------------------------------------------------------------------

SRC = str(Path(__file__).resolve().parent.parent / "src")


def tenplex(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.Popen([sys.executable, "-m", "tenplex.cli.main", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)  # fmt: skip


@pytest.mark.dist
def test_demo_changes_every_dimension_redeploys_survives_a_failure_and_matches_the_static_run(tmp_path):
    p = tenplex("demo", "--run-dir", str(tmp_path / "demo"), "--steps", "60", "--quiet")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    s = json.loads((tmp_path / "demo" / "summary.json").read_text())
    layouts = [(r["from"], r["to"]) for r in s["reconfigurations"]]
    changed = {
        dim for a, b in layouts for dim in ("dp", "tp", "pp") if a.split(dim)[1][0] != b.split(dim)[1][0]
    }
    assert changed == {"dp", "tp", "pp"}
    kinds = {
        ("failure" if r["failure"] else "redeploy" if r["redeploy"] else "planned")
        for r in s["reconfigurations"]
    }
    assert kinds == {"planned", "redeploy", "failure"}
    assert s["static"]["match"], s["static"]
    assert s["ledger"]["ok"] and s["ledger"]["replayed_steps"]
    for r in s["reconfigurations"]:
        assert r["source"] == "memory"
        assert r["bytes"].get("cross_host", 0) == r["plan"]["cross_host_lower_bound"]
    assert (tmp_path / "demo" / "demo.png").stat().st_size > 10_000


@pytest.mark.dist
def test_a_rerun_resumes_after_the_controller_is_killed_mid_reconfiguration(tmp_path):
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"step": 0, "devices": 2}, {"step": 6, "devices": 4}]))
    run_dir = tmp_path / "run"
    args = ["run", "--schedule", str(schedule), "--run-dir", str(run_dir), "--steps", "12",
            "--global-batch", "8", "--snapshot-every", "2", "--job", "resume-test"]  # fmt: skip
    p = tenplex(*args)
    deadline = time.time() + 300
    timeline = run_dir / "timeline.jsonl"
    while time.time() < deadline:  # wait for the second phase to be launched, then kill the controller
        if timeline.exists() and timeline.read_text().count('"kind": "launch"') >= 2:
            break
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    cluster = json.loads((run_dir / "cluster.json").read_text())
    try:
        # the new phase started ahead was told to go when step 6 committed: it may have snapshotted since,
        # and a commit its ranks sent just before they died with the controller may still be landing on the
        # stores (one after the other): read the newest step once it has held for a second
        urls = [s["url"] for s in cluster["stores"].values()]
        committed, settled = newest_step("resume-test", urls), time.time() + 15
        while time.time() < settled:
            time.sleep(1.0)
            now = newest_step("resume-test", urls)
            if now == committed:
                break
            committed = now
        assert committed is not None and committed >= 6
        again = tenplex(*args)
        out, _ = again.communicate(timeout=300)
        assert again.returncode == 0, out[-3000:]
        assert f"resuming job resume-test from its committed step {committed}" in out
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["ledger"]["ok"] and s["steps"] == 12
        # the finished run stopped every store it started, the one the killed controller never recorded too
        assert "final state (PyTorch DCP)" in out
        urls = [u for log in run_dir.glob("store-*.log") for u, _ in logged_stores(str(log))]
        deadline = time.time() + 10
        while any(health(u) for u in urls) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(health(u) for u in urls)
    finally:
        for store in cluster["stores"].values():
            try:
                os.kill(store["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass


@pytest.mark.dist
def test_a_reconfiguration_itself_changes_nothing_bit_for_bit(tmp_path):
    """A job stopped, saved, restarted and loaded in the same layout is bit-identical to one that never
    stopped; a different layout differs only by its summation order (measured here: the demo's tolerance)."""
    from tenplex.cli.main import main as cli_main
    from tenplex.runtime.controller import Controller, RunConfig
    from tenplex.runtime.demo import LOSS_TOLERANCE, PARAM_TOLERANCE, compare_parameters
    from tenplex.runtime.report import losses, timeline
    from tenplex.train.config import TrainConfig

    train = TrainConfig(model="tiny", global_batch=12, seed=0, lr=3e-3, warmup=5, steps=60, device="cpu")

    def job(name, schedule):
        return Controller(RunConfig(train, parse_schedule(schedule), 60, tmp_path / name, job=name,
                                    snapshot_every=0, persist=False, quiet=True))  # fmt: skip

    runs = {
        "one": job("one", [{"step": 0, "devices": 1}]),
        "dp2": job("dp2", [{"step": 0, "devices": 2, "layout": {"dp": 2}}]),
        "dp2-restarted": job(
            "dp2-restarted",
            [{"step": 0, "devices": 2, "layout": {"dp": 2}}, {"step": 30, "devices": 2, "layout": {"dp": 2}}],
        ),
    }
    try:
        for c in runs.values():
            c.run()
        curves = {k: losses(timeline(c.cfg.run_dir)) for k, c in runs.items()}
        assert curves["dp2-restarted"] == curves["dp2"]
        assert compare_parameters(runs["dp2-restarted"], runs["dp2"]) == 0.0
        layout_noise = max(abs(curves["dp2"][s] - curves["one"][s]) for s in curves["one"])
        param_noise = compare_parameters(runs["dp2"], runs["one"])
        print(f"static dp2 vs one device, 60 steps: loss {layout_noise:.2e}, parameters {param_noise:.2e}")
        assert 0 < layout_noise <= LOSS_TOLERANCE
        assert param_noise <= PARAM_TOLERANCE
        # and the one-device run is `tenplex train`'s, which knows nothing of snapshots (a fresh resume
        # used to leave AdamW a step ahead: 0.07 apart; now fp32 round-off of other thread counts)
        metrics = tmp_path / "train.jsonl"
        flags = "--model tiny --global-batch 12 --seed 0 --lr 3e-3 --warmup 5 --steps 60 --no-progress"
        assert cli_main(["train", *flags.split(), "--metrics", str(metrics)]) == 0
        plain = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())}
        assert max(abs(plain[s] - curves["one"][s]) for s in curves["one"]) <= LOSS_TOLERANCE
    finally:
        for c in runs.values():
            c.hosts.shutdown()


def test_a_rerun_catches_up_on_the_records_a_killed_controller_never_read(tmp_path):
    """The killed controller read phase 1 up to step 7; its ranks trained to 9 and saved. The rerun's
    timeline gets steps 8 and 9 (once: a second catch-up adds nothing), so the summary counts them."""
    from tenplex.runtime.monitor import catch_up, into_timeline
    from tenplex.runtime.record_types import Saved, Step
    from tenplex.runtime.records import Records, read_records
    from tenplex.runtime.report import losses, timeline

    for index, steps in ((0, range(1, 7)), (1, range(7, 10))):
        ranks = Records(tmp_path / f"phase{index}" / "worker.jsonl")
        for s in steps:
            ranks.write(Step(s, 10.0 - s))
        ranks.write(Saved(steps[-1], 0.1, 0))
        ranks.close()
    tl = Records(tmp_path / "timeline.jsonl")
    for index, read in ((0, 7), (1, 1)):  # all of phase 0; phase 1's first step
        for r in read_records(tmp_path / f"phase{index}" / "worker.jsonl")[0][:read]:
            into_timeline(tl, index, r)
    assert catch_up(tl, tmp_path, 2) == 3  # steps 8, 9 and the final save of phase 1
    assert catch_up(tl, tmp_path, 2) == 0
    tl.close()
    assert losses(timeline(tmp_path)) == {s: 10.0 - s for s in range(1, 10)}


# -- a phase started ahead -------------------------------------------------------------------------------


@pytest.mark.dist
def test_a_phase_started_ahead_is_cancelled_when_the_one_before_crashes_and_taken_when_it_ends(tmp_path):
    """The next layout's ranks start while the current one trains. A rank of the current phase killed on
    its own (a crash, no schedule event) ends it otherwise than planned: the phase started ahead is
    cancelled, its ranks end without loading anything and its directory goes; the recovery runs as any
    other, and the phase after it, started ahead too, is taken and told to go at its step."""
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"step": 0, "devices": 2}, {"step": 40, "devices": 3}]))
    run_dir = tmp_path / "run"
    p = tenplex("run", "--schedule", str(schedule), "--run-dir", str(run_dir), "--steps", "44",
                "--global-batch", "12", "--snapshot-every", "5", "--job", "ahead", "--quiet")  # fmt: skip
    timeline = run_dir / "timeline.jsonl"
    deadline, killed = time.time() + 300, None
    while time.time() < deadline and p.poll() is None and killed is None:
        recs = [json.loads(x) for x in timeline.read_text().splitlines()] if timeline.exists() else []
        ready = [r for r in recs if r.get("event") == "ready" and r["phase"] == 0]
        if ready and any(r["kind"] == "ahead" for r in recs):
            killed = ready[0]["pids"][1]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    out, _ = p.communicate(timeout=300)
    assert killed is not None and p.returncode == 0, out[-3000:]
    recs = [json.loads(x) for x in timeline.read_text().splitlines()]
    order = [(r["kind"], r.get("phase"), r.get("ahead", False)) for r in recs
             if r["kind"] in ("ahead", "crash", "launch")]  # fmt: skip
    assert order == [("launch", 0, False), ("ahead", 1, False), ("crash", 0, False), ("launch", 1, False),
                     ("ahead", 2, False), ("launch", 2, True)], order  # fmt: skip
    waiting = [r["phase"] for r in recs if r.get("event") == "waiting"]
    assert waiting == [2]  # the cancelled phase's records were never taken: its directory is gone
    # the old phase's rank 0 said go right after its final commit, before its `done` record
    done_at = next(r["at"] for r in recs if r.get("event") == "done" and r["phase"] == 1)
    go_at = next(r["go_at"] for r in recs if r.get("event") == "ready" and r["phase"] == 2)
    assert go_at <= done_at, (go_at, done_at)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 44 and s["ledger"]["ok"]
    change = s["reconfigurations"][-1]
    assert (change["from"], change["to"], change["failure"]) == ("dp2-tp1-pp1", "dp3-tp1-pp1", False)
    assert change["parts"]["start"] == change["parts"]["process_group"] == 0.0  # done ahead
    assert change["downtime"] < change["save_seconds"] + change["load_seconds"] + 0.5 + change["parts"]["go"]


STARTED_AHEAD = """
import json, os, sys, time, torch
from pathlib import Path
from tenplex.runtime.channel import Channel
from tenplex.runtime.job import ElasticJob
from tenplex.runtime.spec import WorkerSpec

out = Path(sys.argv[1])
channel = Channel("127.0.0.1")  # the controller's end, here in the rank's own process
channel.serve()
spec = WorkerSpec(job="j", until=4, out=str(out), ahead=True, control=channel.address, phase=1)
spec.to_file(out / "spec.json")
os.environ.update(TENPLEX_WORKER_SPEC=str(out / "spec.json"), RANK="0", WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
job = ElasticJob()
"""  # a one-rank job of phase 1, started ahead: its directory argv[1], its group's port argv[2]

CANCELLED = (
    STARTED_AHEAD
    + """
getattr(channel, sys.argv[3])(1)
print("turn", job.wait_turn(), job.wait_turn(), flush=True)  # asked once
job.resume({"w": torch.zeros(2)})
print("resumed")
"""
)


# no store runs for these scripts: one that cannot be asked is a lost store, not an empty one, so the job
# starts over only because it is told to (TENPLEX_FRESH, as `tenplex run --fresh` does)
NO_STORE = dict(os.environ, PYTHONPATH=SRC, TENPLEX_FRESH="1")


def test_a_script_started_ahead_waits_for_its_turn_and_ends_cleanly_when_cancelled(tmp_path):
    from tenplex.util import free_port

    for word, turn in (("cancel", "False"), ("go", "True")):
        out = tmp_path / word
        out.mkdir()
        r = subprocess.run([sys.executable, "-c", CANCELLED, str(out), str(free_port()), word],
                           capture_output=True, text=True, timeout=120, env=NO_STORE)  # fmt: skip
        lines = r.stdout.split("\n")
        assert lines[0] == f"turn {turn} {turn}", r.stdout + r.stderr
        if word == "cancel":  # PhaseCancelled: exit 0, nothing loaded
            assert r.returncode == 0 and "resumed" not in r.stdout, r.stderr
        else:  # told to go: it loads (nothing to load here: a fresh start)
            assert r.returncode == 0 and "resumed" in r.stdout, r.stderr


LATE = (
    STARTED_AHEAD
    + """
told = time.time()
channel.go(1)
time.sleep(0.5)  # still building when told to go
job.resume({"w": torch.zeros(2)})
job.ready(0)
records = map(json.loads, (out / "worker.jsonl").read_text().splitlines())
rec = next(r for r in records if r["kind"] == "ready")
print(round(rec["go_at"] - told, 2))  # told when the turn was given, not 0.5 s later
"""
)


def test_a_rank_still_building_when_told_to_go_counts_the_wait_as_build_not_go(tmp_path):
    """A phase started ahead is told to go when its turn is given; a rank that sees it only after it
    finished building must not make the downtime breakdown call its late build `go`."""
    from tenplex.util import free_port

    r = subprocess.run([sys.executable, "-c", LATE, str(tmp_path), str(free_port())], capture_output=True,
                       text=True, timeout=120, env=NO_STORE)  # fmt: skip
    assert r.returncode == 0 and r.stdout.split() == ["0.0"], r.stdout + r.stderr


AT_EXIT = """
import atexit, os, sys
import torch.distributed as dist
from tenplex.transformer.world import init_distributed

atexit.register(lambda: print("at exit, group alive:", dist.is_initialized(), flush=True))  # runs last
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
init_distributed("cpu")
print("group alive:", dist.is_initialized(), flush=True)
"""


def test_the_group_tenplex_made_is_destroyed_before_the_interpreter_exits():
    """A script that ends without destroy_process_group must not leave the gloo group to the interpreter's
    teardown, where it can abort a cleanly ended process."""
    from tenplex.util import free_port

    r = subprocess.run([sys.executable, "-c", AT_EXIT, str(free_port())], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=SRC))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["group alive: True", "at exit, group alive: False"], r.stdout + r.stderr


@pytest.mark.dist
def test_ranks_that_cannot_be_started_ahead_are_started_at_the_boundary(tmp_path):
    """Starting a phase ahead is an optimization: when its ranks cannot be started (here the launcher
    refuses every spec marked ahead), the run says so and starts the phase at its step as usual."""
    from tenplex.runtime.controller import Controller, RunConfig
    from tenplex.runtime.report import summary
    from tenplex.runtime.standby import StandbyError
    from tenplex.train.config import TrainConfig

    train = TrainConfig(model="tiny", global_batch=12, seed=0, lr=3e-3, warmup=5, steps=8, device="cpu")
    sched = parse_schedule([{"step": 0, "devices": 2}, {"step": 4, "devices": 3}])
    ctl = Controller(RunConfig(train, sched, 8, tmp_path / "run", job="refused", snapshot_every=2,
                               persist=False, quiet=True))  # fmt: skip
    launch = ctl.launcher.launch

    def refuse_ahead(phase, spec, script):
        if spec.ahead:
            raise StandbyError("no rank process could be started")
        return launch(phase, spec, script)

    ctl.launcher.launch = refuse_ahead
    try:
        ctl.run()
    finally:
        ctl.hosts.shutdown()
    recs = [json.loads(x) for x in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines()]
    skipped = [r for r in recs if r["kind"] == "ahead_skipped"]
    assert [r["phase"] for r in skipped] == [1] and "StandbyError" in skipped[0]["error"]
    assert [(r["phase"], r.get("ahead", False)) for r in recs if r["kind"] == "launch"] == [
        (0, False),
        (1, False),
    ]
    s = summary(tmp_path / "run")
    assert s["steps"] == 8 and s["ledger"]["ok"]


@pytest.mark.dist
def test_a_rerun_whose_stores_are_lost_stops_with_them_named_and_starts_over_only_with_fresh(tmp_path):
    """The controller and its stores die before anything was persisted: a rerun of the same run directory
    must not take the new, empty stores' word for "no snapshot" (the run's record names the stores its
    snapshots were on): it stops with them named, and `--fresh` is the one way to start over."""
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"step": 0, "devices": 2}]))
    run_dir = tmp_path / "run"
    args = ["run", "--schedule", str(schedule), "--run-dir", str(run_dir), "--steps", "8",
            "--global-batch", "8", "--snapshot-every", "2", "--job", "lost-test"]  # fmt: skip
    p = tenplex(*args, start_new_session=True)
    record = run_dir / "lost-test.json"  # the job's record of its stores, kept with the run
    deadline = time.time() + 300
    while time.time() < deadline and not record.exists():
        time.sleep(0.2)
    assert record.exists(), "no snapshot was committed"
    os.killpg(p.pid, signal.SIGKILL)  # the controller and every rank of its session
    p.wait()
    for store in json.loads((run_dir / "cluster.json").read_text())["stores"].values():
        os.kill(store["pid"], signal.SIGKILL)  # a lost host: its store is gone with the snapshots
    again = tenplex(*args)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 2, out[-3000:]
    assert "lost-test" in out and "store(s) that may hold one are lost" in out and "--fresh" in out
    assert "unreachable" in out
    fresh = tenplex(*args, "--fresh")
    out, _ = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, out[-3000:]
    assert "starting from step 0 (--fresh)" in out or '"fresh"' in (run_dir / "timeline.jsonl").read_text()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 8 and s["ledger"]["ok"]
