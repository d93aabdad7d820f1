import gc
import time

import pytest
from hypothesis import HealthCheck, given, settings

from plan_checks import check_plan
from strategies import ptc_pairs, ptc_pairs_with_lost
from tenplex.planner import Route, central_plan, plan
from tenplex.planner.plan import PlanError
from tenplex.ptc import PTC, Mesh, Placement, TensorMeta, device_id, gpt_ptc, preset


@given(ptc_pairs_with_lost())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_plan_rebuilds_every_new_shard_bit_for_bit(case):
    check_plan(*case)


@given(ptc_pairs())
@settings(max_examples=60, deadline=None)
def test_central_plan_delivers_the_same_boxes(pair):
    old, new = pair
    p, c = plan(old, new), central_plan(old, new)
    key = lambda f: (f.tensor, f.box, f.dst)  # noqa: E731
    assert sorted(map(key, p.fetches()), key=str) == sorted(map(key, c.fetches()), key=str)
    assert c.stats.cross_host >= p.stats.cross_host


def test_identity_moves_nothing():
    ptc = gpt_ptc(preset("tiny"), 2, 2, 2, devices_per_host=4)
    p = plan(ptc, ptc)
    assert p.stats.kept == p.stats.delivered > 0
    assert p.stats.same_host == p.stats.cross_host == p.stats.relayed == 0
    assert all(f.route is Route.KEPT and f.src == f.dst for f in p.fetches())


def test_new_replicas_spread_their_pulls_over_the_old_replicas():
    """Redeploy a dp=4 job onto 4 fresh hosts: every old host should send about a quarter."""
    cfg = preset("small")
    old = gpt_ptc(cfg, 4, 1, 1, devices_per_host=1)
    fresh = [(device_id(10 + i, 0), f"h{10 + i}") for i in range(4)]
    new = gpt_ptc(cfg, 4, 1, 1, devices=fresh)
    s = plan(old, new).stats
    egress = [s.host_egress.get(f"h{i}", 0) for i in range(4)]
    assert s.cross_host == 4 * old.total_bytes
    assert max(egress) / min(egress) < 1.05, egress


def test_each_remote_box_crosses_once_per_host():
    """Two new ranks on one fresh host need the same replicated tensor: one transfer, one relay."""
    meta = TensorMeta("w", (8, 8), "float32")
    old = PTC.build(Mesh.build({"dp": 1}, devices_per_host=1), [(meta, Placement.of())])
    new = PTC.build(Mesh.build({"dp": 2}, devices=[("x/0", "x"), ("x/1", "x")]), [(meta, Placement.of())])
    s = plan(old, new).stats
    assert s.cross_host == 256 and s.relayed == 256


def test_lost_hosts_are_reported_by_tensor_and_box():
    cfg = preset("tiny")
    old = gpt_ptc(cfg, 1, 2, 2, devices_per_host=2)  # stage 1 lives only on host h1
    new = gpt_ptc(cfg, 1, 2, 1, devices_per_host=2)
    p = plan(old, new, lost=["h1"])
    names = {t for t, _ in p.unrecoverable}
    assert "model.blocks.1.attn.qkv.weight" in names and "model.head.weight" in names
    assert not any(n.startswith("model.blocks.0.") for n in names)
    assert not p.complete
    assert plan(old, new, lost=["h0/d0"]).unrecoverable  # a device id works too


def test_incompatible_layouts_are_rejected():
    a = PTC.build(Mesh.build({"dp": 1}), [(TensorMeta("w", (4,), "float32"), Placement.of())])
    b = PTC.build(Mesh.build({"dp": 1}), [(TensorMeta("w", (5,), "float32"), Placement.of())])
    c = PTC.build(Mesh.build({"dp": 1}), [(TensorMeta("v", (4,), "float32"), Placement.of())])
    with pytest.raises(PlanError, match=r"'w' is float32\[4\] in the old layout but float32\[5\]"):
        plan(a, b)
    with pytest.raises(PlanError, match="only in the old: \\['w'\\]"):
        plan(a, c)
    with pytest.raises(PlanError, match="not in the old layout"):
        plan(a, a, lost=["h9"])


def _plan_seconds(sizes: list[tuple[int, int]], repeat: int = 5) -> list[float]:
    """Best of `repeat` per size, sizes interleaved so a burst of load on a shared machine hits all alike.

    CPU seconds of this process, not wall time: time spent waiting for a core another job holds is not the
    planner's (the time bounds in these tests have failed for it on a loaded machine)."""
    cfg = preset("gpt3-175b")
    pairs = [(gpt_ptc(cfg, a, 8, 16), gpt_ptc(cfg, b, 8, 16)) for a, b in sizes]
    best = [float("inf")] * len(pairs)
    gc.disable()
    try:
        for _ in range(repeat):
            for i, (old, new) in enumerate(pairs):
                t = time.process_time()
                plan(old, new)
                best[i] = min(best[i], time.process_time() - t)
    finally:
        gc.enable()
    return best


def test_gpt3_175b_on_2048_devices_plans_in_under_two_seconds():
    """CPU seconds (see _plan_seconds); 0.09 s of planning on an idle core, the rest builds the PTCs."""
    cfg = preset("gpt3-175b")
    t = time.process_time()
    old = gpt_ptc(cfg, 8, 8, 16)  # 1024 devices
    new = gpt_ptc(cfg, 16, 8, 16)  # 2048 devices
    p = plan(old, new)
    elapsed = time.process_time() - t
    assert elapsed < 2.0, elapsed
    assert p.complete and p.stats.cross_host == p.stats.cross_host_lower_bound


def test_planning_time_grows_about_linearly():
    # 4x the devices (two doublings): linear planning takes about 4x (a little less, some work is per
    # tensor), a quadratic overlap search 16x; a 4x span keeps timer noise and fixed costs from deciding it
    small, large = _plan_seconds([(4, 8), (16, 32)])
    assert 2.0 < large / small < 6.0, (small, large)
