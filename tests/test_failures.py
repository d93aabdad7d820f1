"""Hosts die: loads come from surviving replicas, name what is lost, and fall back to the DCP snapshot."""

from __future__ import annotations

import pytest

from launch import run_ranks
from tenplex.store import start_store

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    a, b, c = start_store(), start_store(), start_store()
    try:
        env = {
            "TENPLEX_EMULATED_HOSTS": "1",
            "TENPLEX_TEST_KILL_PID": str(b.proc.pid),
            "TENPLEX_TEST_KILL_PID2": str(c.proc.pid),
            "TENPLEX_TEST_DCP": str(tmp_path_factory.mktemp("dcp") / "stages"),
            "TENPLEX_TEST_B": b.url,
            "TENPLEX_TEST_C": c.url,
        }
        yield [
            *run_ranks(
                "failure_cases", 4, env=env, per_rank_env=[{"TENPLEX_STORE": s.url} for s in (a, a, b, b)]
            ),
            {"b": b.url, "c": c.url},
        ]
    finally:
        for s in (a, b, c):
            s.stop()


def test_dp_replicas_on_a_surviving_host_serve_the_load(results):
    urls = results[-1]
    for r in range(2):
        res = results[r]["dp_replicas"]
        assert res.get("bad") == [], res
        assert res["lost"] == [urls["b"]]
        assert res["bytes"]["cross_host"] == 0


def test_store_replica_serves_a_stage_whose_host_died(results):
    for r in range(2):
        res = results[r]["store_replica"]
        assert res.get("bad") == [] and res["source"] == "memory", res
        assert res["lost"] == []  # B's blobs were found on C


def test_lost_boxes_are_named_and_the_durable_snapshot_takes_over(results):
    for r in range(2):
        unrec = results[r]["unrecoverable"]
        assert "have no surviving copy" in unrec["message"], unrec
        names = {t for t, _ in unrec["boxes"]}
        assert "optim.state.lin.weight.exp_avg" in names  # a stage-1 tensor
        assert "model.emb.weight" not in names  # stage 0 survived on host A
        durable = results[r]["durable"]
        assert durable.get("bad") == [] and durable["source"] == "durable", durable
