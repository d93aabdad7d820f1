"""Elastic jobs across namespace hosts: every host its own network, address, store and agent or ranks.

`tenplex run --network netns`: a scale-out, a redeploy, a host failure recovered from store replicas and a
partition, against a static run of the same steps (losses within the fp32 drift of a layout change), every
sample exactly once, nothing of the run's network left afterwards.

torchrun: two agents, each in its own namespace host with its own store bound to the host's address
(token), c10d rendezvous hosted on host A's address, gloo over the hosts' interfaces. A trains alone,
B joins (world 4), B leaves (world 2); every start loads the newest snapshot, across the hosts' link.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import DEVNULL

import pytest

from launch import SRC
from tenplex.runtime import netns
from tenplex.runtime.netns import Network
from test_torchrun import JOB, RDZV_CONF, STEPS, TABLE, _attempts, _stop, _wait

WHY = netns.unavailable()
pytestmark = [pytest.mark.dist, pytest.mark.skipif(WHY is not None, reason=WHY or "")]
RDZV_PORT = 29400
TOKEN = "netns-torchrun-token-0123456789abcdef"  # 128 bits or more, as a token file must hold


@pytest.fixture
def net(request, tmp_path):
    """A network of this test's own; afterwards none of its namespaces and no tenplex link is left."""
    prefix = netns.prefix_for(f"test:{request.node.nodeid}:{os.getpid()}")
    with Network(prefix) as n:
        yield n
    assert netns.namespaces(prefix) == []


def test_torchrun_agents_in_namespace_hosts_join_and_leave(net: Network, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (tmp_path / "table.json").write_text(json.dumps(TABLE))
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)  # a token file must be its owner's alone
    hosts = [net.add_host("h0"), net.add_host("h1")]
    logs = [str(tmp_path / f"store-{h.name}.log") for h in hosts]
    urls = [net.start_store(h.name, str(token), log, "1GiB")[0] for h, log in zip(hosts, logs)]
    rdzv = f"{hosts[0].addr}:{RDZV_PORT}"
    agents = {}

    def agent(i: int):
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
            TENPLEX_STORE=urls[i],
            TENPLEX_SOURCES=",".join(urls),
            TENPLEX_EMULATED_HOSTS="1",
            TENPLEX_STORE_TOKEN=TOKEN,
            GLOO_SOCKET_IFNAME=netns.NIC,
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # see test_torchrun
        )
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", f"--rdzv-id={JOB}",
            # host A serves the rendezvous on its own address (torch cannot tell it is its own)
            f"--rdzv-conf={RDZV_CONF},is_host={int(i == 0)}", f"--local-addr={hosts[i].addr}",
            "--max-restarts=5", "--monitor-interval=0.5",
            "-m", "tenplex.runtime.elastic", "--model", "tiny", "--steps", str(STEPS), "--global-batch", "12",
            "--job", JOB, "--snapshot-every", "2", "--min-step-seconds", "0.4", "--out", str(out),
            "--table", str(tmp_path / "table.json"),
        ]  # fmt: skip
        with open(tmp_path / f"agent-{i}.log", "w") as log:
            agents[i] = net.popen(hosts[i].name, cmd, env=env, stdout=log, stderr=log, stdin=DEVNULL)
        return agents[i]

    def world_steps(world: int) -> int:
        return sum(len(a["steps"]) for a in _attempts(out) if a["ready"] and a["ready"]["world"] == world)

    try:
        a = agent(0)
        _wait("A to train alone", lambda: world_steps(2) >= 4, agents, 120)
        moved_before = net.counters("h1")["bytes_in"]
        b = agent(1)
        _wait("the 4-worker world to train", lambda: world_steps(4) >= 3, agents, 120)
        _stop(b)
        del agents[1]
        a.wait(150)
        assert a.returncode == 0, (tmp_path / "agent-0.log").read_text()[-4000:]
    finally:
        for p in agents.values():
            _stop(p)

    starts = _attempts(out)
    worlds = [s["ready"]["world"] for s in starts if s["ready"]]
    assert 4 in worlds and worlds[0] == 2 and worlds[-1] == 2, worlds
    assert [s["start"]["kind"] for s in starts] == ["fresh"] + ["loaded"] * (len(starts) - 1)
    assert starts[-1]["done"] and starts[-1]["done"]["step"] == STEPS
    # B's ranks loaded their part of the snapshot from A's store over the hosts' link
    assert net.counters("h1")["bytes_in"] - moved_before > 100_000
    first: dict[int, float] = {}
    for s in starts:  # a replayed step gives the same loss in any layout
        for r in s["steps"]:
            ref = first.setdefault(r["step"], r["loss"])
            assert abs(r["loss"] - ref) < 1e-2, (r["step"], r["layout"], r["loss"], ref)


# No periodic snapshots: the only ones in memory are the reconfigurations' saves, so which one each
# recovery loads, and from where, is known.
NETNS_SCHEDULE = [
    {"step": 0, "devices": 2},  # h0
    {"step": 4, "devices": 4},  # scale-out onto h1; the save at step 4 is all on h0's store (+ a replica)
    {"step": 6, "fail_hosts": ["h0"]},  # recovery on h1 from step 4: only h0's replica on h1 has it
    {"step": 10, "redeploy": True},  # onto h2
    {"step": 14, "devices": 4},  # h2 and the first unused host left, h1
    {"step": 18, "partition": ["h1"]},  # cut off: detected, dropped, the job goes on on h2 from step 14
]


def tenplex_cli(*args: str, timeout: float = 420) -> str:
    """`tenplex ARGS`; one that runs past `timeout` fails with every thread's stack (SIGUSR1), and its
    namespaces and their processes are removed: a hung run must not leave its network behind."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "tenplex.cli.main", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        p.kill()
        out, err = p.communicate()
        netns.cleanup(netns.prefix_for(str(Path(args[args.index("--run-dir") + 1]).resolve())))
        pytest.fail(f"tenplex {' '.join(args)} ran past {timeout} s; its stacks:\n{err[-8000:]}")
    assert p.returncode == 0, (out + err)[-4000:]
    return out


def test_tenplex_run_on_namespace_hosts_scales_redeploys_survives_a_host_and_a_partition(tmp_path):
    from tenplex.runtime.demo import LOSS_TOLERANCE

    (tmp_path / "elastic.json").write_text(json.dumps(NETNS_SCHEDULE))
    (tmp_path / "static.json").write_text(json.dumps([{"step": 0, "devices": 1}]))
    common = ["--steps", "22", "--global-batch", "8", "--snapshot-every", "0", "--quiet"]
    run_dir = tmp_path / "elastic"
    net = ["--network", "netns", "--nic-gbps", "1", "--replicas", "1"]
    tenplex_cli("run", "--schedule", str(tmp_path / "elastic.json"), "--run-dir", str(run_dir),
                "--job", "nsjob", *net, *common)  # fmt: skip
    assert netns.namespaces(netns.prefix_for(str(run_dir.resolve()))) == []
    tenplex_cli("run", "--schedule", str(tmp_path / "static.json"), "--run-dir", str(tmp_path / "static"),
                "--job", "static", *common)  # fmt: skip
    s = json.loads((run_dir / "summary.json").read_text())
    ref = json.loads((tmp_path / "static" / "summary.json").read_text())
    assert s["steps"] == 22 and s["ledger"]["ok"], s["ledger"]
    diff = max(abs(s["losses"][k] - ref["losses"][k]) for k in ref["losses"])
    assert len(s["losses"]) == len(ref["losses"]) and diff <= LOSS_TOLERANCE, diff
    recs = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in recs]
    assert "fail" in kinds and "partition" in kinds and "heal" in kinds
    detected = next(r for r in recs if r["kind"] == "partition_detected")
    assert detected["hosts"] == ["h1"] and max(detected["seconds"].values()) < 15
    assert [r["step"] for r in recs if r["kind"] == "recover"] == [4, 14]
    loads = [r for r in recs if r["kind"] == "worker" and r.get("event") == "loaded"]
    # the recovery's load of step 4: h0, which held all of it, is dead; h1's replica served it, not DCP
    assert [r["step"] for r in loads][:2] == [4, 4] and loads[1]["source"] == "memory"
    assert all(r["source"] == "memory" for r in s["reconfigurations"]), s["reconfigurations"]
    # every host's address and traffic: h1 took its part of the scale-out over its link
    hosts = s["hosts"]
    assert {"h0", "h1", "h2"} <= set(hosts) and hosts["h0"]["failed"]
    assert len({h["addr"] for h in hosts.values()}) == len(hosts)
    assert hosts["h1"]["bytes_in"] > 100_000 and hosts["h1"]["cut_off"]
    assert not any(e["kind"] == "persist_failed" for e in recs)
