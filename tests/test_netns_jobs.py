"""Elastic jobs across namespace hosts: every host its own network, address, store and agent or ranks.

torchrun: two agents, each in its own namespace host with its own store bound to the host's address
(token), c10d rendezvous hosted on host A's address, gloo over the hosts' interfaces. A trains alone,
B joins (world 4), B leaves (world 2); every start loads the newest snapshot, across the hosts' link.
"""

from __future__ import annotations

import json
import os
import sys
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
    token.write_text("netns-torchrun-token\n")
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
            TENPLEX_STORE_TOKEN="netns-torchrun-token",
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
