"""Standby rank processes: a role runs in a pre-imported process with its own environment and output."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tenplex.runtime.channel import Channel
from tenplex.runtime.standby import StandbyPool


@pytest.fixture(scope="module")
def channel() -> Channel:
    """The runtime's store, as a controller serves it: exit codes come back through it."""
    c = Channel("127.0.0.1")
    c.serve()
    return c


SCRIPT = """
import os, sys
print("role", os.environ["ROLE"], "torch imported before:", "torch" in sys.modules, sys.argv[1:])
sys.exit(int(os.environ["CODE"]))
"""


def test_a_script_role_runs_pre_imported_with_its_env_args_and_exit_code(tmp_path, channel):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    pool = StandbyPool(tmp_path / "standby.log", dict(os.environ, OMP_NUM_THREADS="1"), channel)
    try:
        pool.fill(2)
        first = pool.idle[0].pid
        role = pool.start({"ROLE": "a", "CODE": "3"}, tmp_path / "a.log", [str(script), "--x", "1"])
        assert role.proc.pid == first and len(pool.idle) == 1  # an idle one took it
        assert role.wait(120) == 3
        assert (tmp_path / "a.log").read_text().strip() == "role a torch imported before: True ['--x', '1']"
        pool.release(role)  # a script's process is never reused
        assert first not in {p.pid for p in pool.idle}
        b = pool.start({"ROLE": "b", "CODE": "0"}, tmp_path / "b.log", [str(script)])
        assert b.wait(120) == 0 and "role b" in (tmp_path / "b.log").read_text()
        assert "ROLE" not in os.environ  # nothing leaks into the controller
    finally:
        pool.close()
    assert pool.idle == []


def test_closing_the_pool_stops_idle_processes(tmp_path, channel):
    pool = StandbyPool(tmp_path / "standby.log", dict(os.environ), channel)
    pool.fill(2)
    procs = list(pool.idle)
    pool.close()
    deadline = time.time() + 10
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.1)
    assert all(p.poll() is not None for p in procs)


def test_a_standby_process_dies_with_the_controller(tmp_path):
    """PR_SET_PDEATHSIG asked by the child itself (no preexec_fn between fork and exec)."""
    import subprocess
    import sys

    parent = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from tenplex.runtime.channel import Channel\n"
        "from tenplex.runtime.standby import StandbyPool\n"
        "from tenplex.util import free_port\n"
        "channel = Channel('127.0.0.1')\n"
        "channel.serve()\n"
        f"log = Path({str(tmp_path / 'standby.log')!r})\n"
        "pool = StandbyPool(log, dict(os.environ), channel, die_with_parent=True)\n"
        "pool.fill(1)\n"
        "print(pool.idle[0].pid, flush=True)\n"
        "os._exit(0)\n"  # no close(): only the death signal can end the child
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60)
    child = int(out.stdout.strip())
    deadline = time.time() + 20
    while time.time() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended (its parent, init, reaps it)


def test_spares_are_forked_from_one_zygote_and_outlive_the_pools_close_while_they_run(tmp_path, channel):
    """The pool's zygote imports once; every spare is its child (a fork: a refill of four is quick), a
    rank's exit code comes back through the zygote, and closing the pool stops idle spares but lets a
    running rank finish."""
    script = tmp_path / "s.py"
    script.write_text("import time, sys; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))\n")
    pool = StandbyPool(tmp_path / "standby.log", dict(os.environ, OMP_NUM_THREADS="1"), channel)
    try:
        pool.fill(1)
        zygote = pool.zygote.proc.pid
        assert _parent(pool.idle[0].pid) == zygote  # waits for the zygote's imports
        t = time.monotonic()
        pool.fill(5)
        assert all(_parent(p.pid) == zygote for p in pool.idle) and len(pool.idle) == 5
        assert time.monotonic() - t < 5  # forks, not five interpreters importing torch on two cores
        quick = pool.start({}, tmp_path / "q.log", [str(script), "0", "7"])
        assert quick.wait(60) == 7
        slow = pool.start({}, tmp_path / "s.log", [str(script), "1.5", "0"])
        idle = list(pool.idle)
    finally:
        pool.close()
    assert all(p.wait(20) == -9 for p in idle)  # killed
    assert slow.poll() is None and slow.wait(30) == 0  # the zygote waited for it


WARMED = """
import os, sys, torch, torch.distributed as dist
from tenplex.train.warmup import warm_up
threads = torch.get_num_threads()
rng = torch.get_rng_state()
warm_up()
assert not dist.is_initialized(), "the warm-up's world is gone"
assert torch.equal(torch.get_rng_state(), rng), "the RNG state is as before"
assert torch.get_num_threads() == threads
warm_up()  # twice is harmless
print(len(os.listdir("/proc/self/task")), "threads")
"""


def test_the_dtensor_warm_up_leaves_no_world_no_thread_and_the_rng_as_it_was(tmp_path):
    """What the zygote does before it forks: a fork must copy no thread's half-held lock and no group."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", WARMED], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "threads"]


def test_the_zygote_forks_with_one_thread_after_its_warm_up(tmp_path, channel):
    pool = StandbyPool(tmp_path / "standby.log", dict(os.environ, OMP_NUM_THREADS="1"), channel)
    try:
        pool.fill(1)
        assert _parent(pool.idle[0].pid) == pool.zygote.proc.pid  # forked: the preload is done
        assert len(os.listdir(f"/proc/{pool.zygote.proc.pid}/task")) == 1
    finally:
        pool.close()


def test_spares_that_end_together_all_get_their_exit_codes(tmp_path, channel):
    """After a failure the survivors end at once. Each spare's exit code must come back however their ends
    interleave with the zygote's reaping (a reap in a Python signal handler lost one now and then: the
    spare stayed a zombie without its code, and the controller waited for it forever)."""
    script = tmp_path / "s.py"
    script.write_text("import sys, time\nt = float(sys.argv[1])\ntime.sleep(max(0.0, t - time.time()))\n"
                      "sys.exit(int(sys.argv[2]))\n")  # fmt: skip
    pool = StandbyPool(tmp_path / "standby.log", dict(os.environ, OMP_NUM_THREADS="1"), channel)
    try:
        for round_ in range(12):
            pool.fill(6)
            at = time.time() + 0.3
            roles = [pool.start({}, tmp_path / f"r{round_}-{i}.log", [str(script), str(at), str(i)])
                     for i in range(6)]  # fmt: skip
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(r.poll() is None for r in roles):
                time.sleep(0.01)
            assert [r.poll() for r in roles] == list(range(6)), f"round {round_}: a spare's code never came"
    finally:
        pool.close()


def test_a_dead_zygote_ends_its_spares_and_the_next_start_forks_from_a_new_one(tmp_path, channel):
    import signal

    pool = StandbyPool(tmp_path / "standby.log", dict(os.environ, OMP_NUM_THREADS="1"), channel)
    try:
        pool.fill(2)
        spares, old = list(pool.idle), pool.zygote.proc
        assert all(p.pid > 0 for p in spares)
        old.send_signal(signal.SIGKILL)
        old.wait(10)
        assert all(p.wait(20) == -9 for p in spares)  # they die with it (PR_SET_PDEATHSIG)
        script = tmp_path / "ok.py"
        script.write_text("print('ran')\n")
        role = pool.start({}, tmp_path / "ok.log", [str(script)])
        assert role.wait(120) == 0 and (tmp_path / "ok.log").read_text().strip() == "ran"
        assert pool.zygote.proc is not old and pool.zygote.proc.poll() is None
    finally:
        pool.close()


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return -1


def test_a_reused_rank_process_trains_a_layout_again_on_its_new_groups(tmp_path):
    """dp2, tp2-pp2, dp2, tp2-pp2: processes of the first tp2-pp2 phase serve the second one (as any rank
    of it). DTensor caches shardings by mesh, and the new mesh equals the old: without `forget_meshes`
    their first step ran on the old mesh, whose groups were destroyed ("Could not resolve the process
    group"), and the phase crashed."""
    from fault_cases import cli, finish, records, run_job

    dp, tp_pp = (
        {"devices": 2, "layout": {"dp": 2, "tp": 1, "pp": 1}},
        {"devices": 4, "layout": {"dp": 1, "tp": 2, "pp": 2}},
    )
    schedule = [{"step": 0, **dp}, {"step": 3, **tp_pp}, {"step": 6, **dp}, {"step": 9, **tp_pp}]
    run_dir = tmp_path / "again"
    finish(cli(*run_job(run_dir, schedule)))
    recs = records(run_dir)
    pids = {r["phase"]: set(r["pids"]) for r in recs if r.get("event") == "ready"}
    assert pids[1] & pids[3], pids  # the case at all: a process ran in both tp2-pp2 phases
    assert not [r for r in recs if r["kind"] == "crash"], [r for r in recs if r["kind"] == "crash"]
    assert json.loads((run_dir / "summary.json").read_text())["ledger"]["ok"]
