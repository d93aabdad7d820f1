"""Fault injection: elastic jobs of the tiny reference model under `tenplex run` (real ranks, real stores),
each with a fault at a step or phase drawn from a seeded RNG, and after it the checks of fault_cases.py:
every step and sample exactly once, losses within the static run's drift, the recovery from the newest
committed snapshot, nothing of the run left behind.

The seed is TENPLEX_FAULT_SEED (default 9; printed). At the end the module prints
`faults injected: N, survived: M` and fails when M < N. `-m slow` adds a longer randomized soak.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from fault_cases import (
    Corrupter,
    check_no_process_left,
    check_nothing_left,
    check_outcome,
    check_recovered_from_newest,
    cli,
    finish,
    kill_controller_at,
    netem_missing,
    records,
    run_job,
    shm_left,
    stop_stores,
    stores_of,
)
from tenplex.runtime import netns
from tenplex.transformer.snapshot import newest_step

SEED = int(os.environ.get("TENPLEX_FAULT_SEED", "9"))
pytestmark = pytest.mark.dist
TALLY = {"injected": 0, "survived": 0, "known": 0}  # known: faults of xfail cases (known bugs)
NO_NETNS = netns.unavailable()


def rng(case: str) -> random.Random:
    """The case's own draws: the same for a seed whichever cases run, and in whatever order."""
    return random.Random(f"{SEED}:{case}")


@pytest.fixture(scope="module", autouse=True)
def tally(request):
    yield TALLY
    line = f"fault seed {SEED}: faults injected: {TALLY['injected']}, survived: {TALLY['survived']}"
    line += f" (and {TALLY['known']} of known bugs, xfail)" if TALLY["known"] else ""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    print(line)


@pytest.fixture(scope="module")
def static(tmp_path_factory) -> dict:
    """The same steps on one device, no fault: the losses every faulted run must match."""
    run_dir = tmp_path_factory.mktemp("faults") / "static"
    finish(cli(*run_job(run_dir, [{"step": 0, "devices": 1}])))
    return json.loads((run_dir / "summary.json").read_text())


class Fault:
    """One injected fault: counted when entered, survived when every check after it passed."""

    def __init__(self, what: str, n: int = 1) -> None:
        self.what, self.n = what, n

    def __enter__(self) -> Fault:
        TALLY["injected"] += self.n
        print(f"fault (seed {SEED}): {self.what}")
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            TALLY["survived"] += self.n


def test_a_rank_killed_mid_phase(tmp_path, static):
    r = rng("rank")
    step, rank = r.randint(3, 9), r.randint(0, 2)
    schedule = [{"step": 0, "devices": 3}, {"step": step, "fail": [rank]}]
    run_dir = tmp_path / "rank"
    with Fault(f"SIGKILL of rank {rank} of 3 at step {step}"):
        finish(cli(*run_job(run_dir, schedule)))
        recs = records(run_dir)
        fail = next(x for x in recs if x["kind"] == "fail")
        assert fail["ranks"] == [rank] and fail["step"] >= step
        check_recovered_from_newest(recs, 2)
        check_outcome(run_dir, static)
        check_nothing_left(run_dir)


def test_the_controller_killed_mid_reconfiguration_then_rerun(tmp_path, static):
    r = rng("controller")
    step = r.choice([4, 6, 8])
    mark = r.choice(['"event": "saved"', '"event": "done"', '"kind": "launch"'])
    need = 2 if "launch" in mark else 1  # the second launch: the new phase is taken
    schedule = [{"step": 0, "devices": 2}, {"step": step, "devices": 3}]
    run_dir = tmp_path / "controller"
    args = run_job(run_dir, schedule)
    with Fault(f"SIGKILL of the controller at step {step}'s reconfiguration, after {mark} x{need}"):
        kill_controller_at(cli(*args), run_dir, lambda text: text.count(mark) >= need)
        # every mark comes after the reconfiguration's save committed; the new phase, started ahead, was
        # told to go then and may have committed a snapshot of its own before its ranks died
        committed = newest_step(run_dir.name, [u for u, _ in stores_of(run_dir)])
        assert committed is not None and committed >= step, committed
        finish(cli(*args))
        resumes = [x["step"] for x in records(run_dir) if x["kind"] == "resume"]
        assert resumes == [committed], (resumes, committed)
        check_outcome(run_dir, static)
        check_nothing_left(run_dir)


def test_the_controller_killed_while_the_new_phase_trains_then_rerun(tmp_path, static):
    """The rerun's phases follow the killed run's (phase2, ...): it appends to none of their files, and its
    record of every step it replays wins over theirs, a step some dp ranks logged and others did not too."""
    r = rng("controller-training")
    step = r.choice([4, 6, 8])
    schedule = [{"step": 0, "devices": 2}, {"step": step, "devices": 3}]
    run_dir = tmp_path / "training"
    args = run_job(run_dir, schedule)
    with Fault(f"SIGKILL of the controller once the phase after step {step}'s reconfiguration trains"):
        kill_controller_at(cli(*args), run_dir, lambda text: '"phase": 1, "event": "step"' in text)
        pids = [x["pid"] for x in records(run_dir) if x.get("event") == "ready" and x["phase"] == 1]
        deadline = time.time() + 30
        while time.time() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.1)
        # rank dp0 killed before it logged the steps after the committed one, which the others had logged
        committed = newest_step(run_dir.name, [u for u, _ in stores_of(run_dir)])
        assert committed is not None and committed >= step, committed
        ledger = run_dir / "phase1" / "ledger-dp0.jsonl"
        lines = ledger.read_text().splitlines(keepends=True)
        ledger.write_text("".join(x for x in lines if json.loads(x)["step"] <= committed))
        finish(cli(*args))
        launches = [x["phase"] for x in records(run_dir) if x["kind"] == "launch"]
        assert launches == sorted(set(launches)) and launches[:2] == [0, 1], launches  # a phase index once
        resumes = [x["step"] for x in records(run_dir) if x["kind"] == "resume"]
        assert resumes == [committed], (resumes, committed)
        check_outcome(run_dir, static)
        check_nothing_left(run_dir)


def test_a_flipped_byte_in_the_snapshots_a_recovery_would_load(tmp_path, static):
    """Bit rot in the stores' memory: the newest snapshots have a byte flipped in one blob file (each tensor
    has one copy: two ranks on one host). The recovery's load finds it (checksums), loads none of it, and
    resumes from the newest snapshot that is intact."""
    r = rng("flip")
    fail, rank = r.choice([7, 9]), r.randint(0, 1)
    schedule = [{"step": 0, "devices": 2}, {"step": fail, "fail": [rank]}]
    run_dir = tmp_path / "flip"
    args = run_job(run_dir, schedule)
    with Fault(f"a byte flipped in each snapshot from step {fail - 3} on, rank {rank} of 2 killed at {fail}"):
        p = cli(*args)
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None and not stores_of(run_dir):
            time.sleep(0.05)
        ((url, _),) = stores_of(run_dir)
        corrupter = Corrupter(url, run_dir.name, fail - 3, run_dir, r)
        corrupter.start()
        finish(p)
        corrupter.join()
        assert corrupter.error is None, corrupter.error
        print(f"flipped: {corrupter.flipped}; committed when the job recovered: {corrupter.seen}")
        recs = records(run_dir)
        (recover,) = [x for x in recs if x["kind"] == "recover"]
        # flipped before the recovery began, so before its load read anything: the load must pass these
        # over. A flip the corrupter's thread made later (a loaded machine can keep it off its core for
        # a few hundred ms) may land after the load read that snapshot intact: then the snapshot is taken
        # whole, as the losses below prove, or, flipped before its read, passed over
        early = {s for s, t in corrupter.when.items() if t < recover["time"]}
        assert early and [s for s in corrupter.seen if s not in corrupter.flipped], (corrupter.seen, early)
        loaded = [x for x in recs if x.get("event") == "loaded" and x["time"] > recover["time"]]
        assert loaded and loaded[0]["source"] == "memory", loaded
        step = loaded[0]["step"]
        assert step not in early, (loaded[0], corrupter.seen, corrupter.when, recover["time"])
        newer = [s for s in sorted(corrupter.seen, reverse=True) if s > step]
        assert all(s in corrupter.flipped for s in newer), (step, corrupter.seen, corrupter.flipped)
        assert [x["step"] for x in loaded[0]["skipped"]] == newer, loaded[0]["skipped"]
        check_outcome(run_dir, static)  # the losses of the static run: no flipped byte was loaded
        check_nothing_left(run_dir)


def test_a_store_too_small_for_the_snapshots_it_is_asked_to_keep(tmp_path, static):
    """--store-memory 4MiB holds two snapshots of the 2-rank phase (1.6 MB each), not the three it keeps
    plus the one being written: the one that does not fit is skipped (MemoryLimitError, said in the
    records; not a lost store, no crash), the job keeps only its newest from then on, and a failure
    recovers from the newest that fit."""
    r = rng("full")
    fail, rank = r.choice([7, 9]), r.randint(0, 1)
    schedule = [{"step": 0, "devices": 2}, {"step": fail, "fail": [rank]}]
    run_dir = tmp_path / "full"
    with Fault(f"a store of 4MiB (room for two snapshots of three kept), rank {rank} of 2 killed at {fail}"):
        finish(cli(*run_job(run_dir, schedule, "--store-memory", "4MiB")))
        recs = records(run_dir)
        full = [x for x in recs if x.get("event") == "store_full"]
        assert full and full[0]["skipped"] and full[0]["step"] == 6, full
        assert all(x["error"].startswith("MemoryLimitError") for x in full), full
        assert not [x for x in recs if x["kind"] in ("crash", "give_up")]
        (recover,) = check_recovered_from_newest(recs, 2)
        loaded = [x for x in recs if x.get("event") == "loaded"]
        assert [x["step"] for x in loaded] == [recover["step"]] and recover["step"] not in [6], loaded
        (end,) = [x for x in recs if x["kind"] == "finish"]
        assert end["durable"].endswith("step-12"), end  # the final state saved (after room was made)
        check_outcome(run_dir, static)
        check_nothing_left(run_dir)


def test_a_store_too_small_for_one_snapshot_ends_the_run_with_one_clear_error(tmp_path):
    """No snapshot fits at all (1MiB): the periodic one is skipped, the final save fails even with nothing
    else kept, and the run ends with exit 1 and one line saying so (not a crash loop, not a lost store)."""
    run_dir = tmp_path / "tiny-store"
    args = run_job(run_dir, [{"step": 0, "devices": 1}], "--store-memory", "1MiB")
    args[args.index("--steps") + 1] = "4"
    with Fault("a store of 1MiB (room for no snapshot of 1.6 MB)"):
        p = cli(*args)
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 1, out[-3000:]
        line = "tenplex run: the state at step 4 does not fit in the stores: MemoryLimitError"
        assert line in out and "--store-memory" in out, out[-3000:]
        recs = records(run_dir)
        assert [x["step"] for x in recs if x.get("event") == "store_full"] == [2, 4], recs
        assert recs[-1]["kind"] == "give_up" and recs[-1]["step"] == 4, recs[-1]  # at once: no crash loop
        stop_stores(run_dir)  # a failed run leaves its stores up, for a rerun
        check_nothing_left(run_dir)


@pytest.fixture(scope="module")
def host_failure(tmp_path_factory) -> tuple[str, Path, list[str]]:
    """A job on two namespace hosts, store replication on, one host killed with its store at a drawn
    step: the host, the run's directory, and the shared memory of its other stores left after it."""
    if NO_NETNS is not None:
        pytest.skip(f"namespace hosts: {NO_NETNS}")
    r = rng("store")
    step, host = r.randint(3, 9), r.choice(["h0", "h1"])
    schedule = [{"step": 0, "devices": 4}, {"step": step, "fail_hosts": [host]}]
    run_dir = tmp_path_factory.mktemp("faults") / "store"
    net = ["--network", "netns", "--replicas", "1", "--devices-per-host", "2"]
    what = f"SIGKILL of host {host} (its store holds the other host's replicas) at step {step}"
    TALLY["injected"] += 1
    print(f"fault (seed {SEED}): {what}")
    finish(cli(*run_job(run_dir, schedule, *net)), timeout=420)
    check_no_process_left(run_dir)
    return host, run_dir, shm_left(run_dir, but=f"store-{host}.log")


def test_a_host_and_its_store_holding_replicas_killed(host_failure, static):
    host, run_dir, left = host_failure
    recs = records(run_dir)
    fail = next(x for x in recs if x["kind"] == "fail")
    assert fail["hosts"] == [host]
    (recover,) = check_recovered_from_newest(recs, 2)
    loaded = [x for x in recs if x.get("event") == "loaded"]
    assert bool(loaded) == (recover["step"] > 0), (recover, loaded)  # step 0: nothing had committed yet
    assert all(x["source"] == "memory" for x in loaded), loaded  # from the replicas, not DCP
    check_outcome(run_dir, static)
    assert netns.namespaces(netns.prefix_for(str(run_dir.resolve()))) == []
    # the stores that ended with the run removed their shared memory; the killed host's store cannot (its
    # directory is reaped by the next store started on the machine: whether the run starts one is timing)
    assert left == [], left
    TALLY["survived"] += 1


def test_a_redeploy_across_hosts_over_a_slow_link(tmp_path, static):
    """Namespace hosts with 8 Mbit/s NICs: a redeploy from h0 to h1 moves the whole state over h0's link;
    the move takes at least what the link allows (1.4 s for the 1.6 MB; the same load unshaped took
    0.34 s here), and the job is as right as on a fast link."""
    if NO_NETNS is not None:
        pytest.skip(f"namespace hosts: {NO_NETNS}")
    gbps, step = 0.008, rng("slow").choice([4, 6, 8])
    schedule = [{"step": 0, "devices": 2}, {"step": step, "redeploy": True}]
    run_dir = tmp_path / "slow"
    net = ["--network", "netns", "--nic-gbps", str(gbps), "--devices-per-host", "2"]
    with Fault(f"{gbps * 1000:g} Mbit/s links, a redeploy from h0 to h1 at step {step}"):
        finish(cli(*run_job(run_dir, schedule, *net)), timeout=300)
        s = check_outcome(run_dir, static)
        (change,) = s["reconfigurations"]
        crossed = change["plan"]["cross_host_lower_bound"]
        rate = gbps * 1e9 / 8
        burst = max(256 << 10, int(rate * 0.002))  # what the shaper lets through at once (runtime.netns)
        least = (crossed - burst) / rate
        print(f"{crossed} bytes over h0's link in {change['load_seconds']:.2f} s (the link: {least:.2f} s)")
        assert crossed > 1 << 20 and change["source"] == "memory" and change["redeploy"], change
        assert change["load_seconds"] >= 0.9 * least, (change, least)
        assert s["hosts"]["h1"]["bytes_in"] >= crossed, s["hosts"]
        assert netns.namespaces(netns.prefix_for(str(run_dir.resolve()))) == []
        check_nothing_left(run_dir)


def test_a_lossy_link_during_a_redeploy(tmp_path, static):
    """1% of h0's packets dropped (netem) while the job is redeployed to h1: TCP retransmits, the state
    arrives whole (checksums), the job is as right as without loss."""
    if NO_NETNS is not None:
        pytest.skip(f"namespace hosts: {NO_NETNS}")
    why = netem_missing()
    if why is not None:
        pytest.skip(f"a lossy link: {why}")
    step = rng("lossy").choice([4, 6, 8])
    schedule = [{"step": 0, "devices": 2}, {"step": step, "redeploy": True}]
    run_dir = tmp_path / "lossy"
    net = ["--network", "netns", "--nic-gbps", "0.2", "--nic-latency-ms", "1", "--devices-per-host", "2"]
    with Fault(f"1% loss on h0's link, a redeploy from h0 to h1 at step {step}"):
        p = cli(*run_job(run_dir, schedule, *net))
        h0 = netns.prefix_for(str(run_dir.resolve())) + "h0"
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None and h0 not in netns.namespaces(h0):
            time.sleep(0.05)
        lossy = ["ip", "netns", "exec", h0, "tc", "qdisc", "change", "dev", netns.NIC, "root", "handle", "1:",
                 "netem", "delay", "1ms", "loss", "1%", "limit", "100000"]  # fmt: skip
        done = subprocess.run(lossy, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        finish(p, timeout=300)
        s = check_outcome(run_dir, static)
        assert s["reconfigurations"][0]["source"] == "memory", s["reconfigurations"]
        check_nothing_left(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(4))
def test_soak_several_ranks_killed_in_one_job(tmp_path, static, round_):
    """Randomized soak: 2-3 ranks killed at drawn steps of one job, the job grown back to 3 between."""
    r = rng(f"soak:{round_}")
    steps = sorted(2 * x + 1 for x in r.sample(range(1, 5), r.randint(2, 3)))  # of 3, 5, 7, 9
    schedule: list[dict] = [{"step": 0, "devices": 3}]
    for a in steps:  # at least 2 apart: a failure, the job grown back, then the next failure
        schedule += [{"step": a, "fail": [r.randint(0, 2)]}, {"step": a + 1, "devices": 3}]
    run_dir = tmp_path / f"soak{round_}"
    with Fault(f"soak round {round_}: {schedule[1:]}", len(steps)):
        finish(cli(*run_job(run_dir, schedule)))
        check_recovered_from_newest(records(run_dir), 2)
        check_outcome(run_dir, static)
        check_nothing_left(run_dir)


def test_zz_every_injected_fault_was_survived():
    """Last in the module (pytest keeps file order): the tally of the faults above."""
    assert TALLY["survived"] >= TALLY["injected"], TALLY
