import os
import time
from collections import Counter
from itertools import permutations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from plan_checks import check_plan
from strategies import ptc_pairs_with_lost, ptcs
from tenplex.planner import assign, plan
from tenplex.planner.assign import _block, _split_groups
from tenplex.planner.transport import transport
from tenplex.ptc import PTC, Box, Explicit, Mesh, Piece, TensorMeta, device_id, gpt_ptc, preset


def brute_force(supply: list[int], capacity: list[int], value: dict) -> int:
    units = [a for a, n in enumerate(supply) for _ in range(n)]
    slots = [b for b, n in enumerate(capacity) for _ in range(n)]
    return max(sum(value.get((a, b), 0) for a, b in zip(units, order)) for order in permutations(slots))


@st.composite
def transport_problems(draw):
    supply = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    total = sum(supply)
    nb = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=nb - 1, max_size=nb - 1)))
    capacity = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    value = {
        (a, b): draw(st.integers(0, 9)) for a in range(len(supply)) for b in range(nb) if draw(st.booleans())
    }
    return supply, capacity, value


@given(transport_problems())
@settings(max_examples=200, deadline=None)
def test_transport_is_optimal_and_places_every_unit(problem):
    supply, capacity, value = problem
    flow = transport(supply, capacity, value)
    assert [sum(row) for row in flow] == supply
    assert [sum(col) for col in zip(*flow)] == capacity if flow else not any(capacity)
    got = sum(n * value.get((a, b), 0) for a, row in enumerate(flow) for b, n in enumerate(row))
    assert got == brute_force(supply, capacity, value)
    assert transport(supply, capacity, value) == flow  # deterministic


def test_transport_rejects_unequal_sums():
    with pytest.raises(ValueError, match="equal sums"):
        transport([2], [1], {})


def _shuffled(ptc: PTC, order: list[int]) -> PTC:
    m = ptc.mesh
    mesh = Mesh(m.axes, tuple(m.devices[i] for i in order), tuple(m.hosts[i] for i in order))
    return PTC(mesh, ptc.tensors, ptc.placements, ptc.values)


@given(ptc_pairs_with_lost())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_assignment_is_a_permutation_never_worse_and_still_exact(case):
    old, new, lost = case
    matched = assign(old, new, lost)
    assert matched.mesh.axes == new.mesh.axes and matched.placements is new.placements
    assert sorted(zip(matched.mesh.devices, matched.mesh.hosts)) == sorted(
        zip(new.mesh.devices, new.mesh.hosts)
    )
    assert _split_groups(matched.mesh) <= _split_groups(new.mesh)  # no more groups split over hosts
    p = check_plan(old, matched, lost)  # the plan into the matched layout is exact, element by element
    assert p.stats.cross_host <= plan(old, new, lost).stats.cross_host
    assert assign(old, new, lost) == matched  # deterministic


@st.composite
def shuffled_layouts(draw) -> tuple[PTC, list[int]]:
    ptc = draw(ptcs())
    return ptc, draw(st.permutations(range(ptc.mesh.size)))


def _explicit(hosts: list[str], axes: tuple, pieces: dict[str, tuple[tuple[int, ...], list]]) -> PTC:
    """A PTC on `hosts` (one device each, in order) with float32 tensors given piece by piece."""
    per: Counter[str] = Counter()
    devices = []
    for h in hosts:
        devices.append(f"{h}/d{per[h]}")
        per[h] += 1
    mesh = Mesh(axes, tuple(devices), tuple(hosts))
    return PTC.build(
        mesh,
        [
            (TensorMeta(name, shape, "float32"), Explicit(tuple(Piece(Box(*b), tuple(hs)) for b, hs in ps)))
            for name, (shape, ps) in pieces.items()
        ],
    )


# found by hypothesis: hosts of 4, 4 and 1 devices, groups of 3, a scalar on ranks 1, 4, 7; the only
# zero-cross-host matchings split more groups than the shuffled numbering, which is kept
NINE = _explicit(
    ["h0"] * 4 + ["h1"] * 4 + ["h2"], (("dp", 3), ("pp", 3)), {"t1.w": ((), [(((), ()), [1, 4, 7])])}
)
# found by hypothesis (a fresh-clone CI run): hosts of 4 and 2, groups of 3; two matchings keep every
# byte in place and the transport took the one splitting both groups (see test_a_tie_is_broken_...)
SIX = _explicit(
    ["h0"] * 4 + ["h1"] * 2,
    (("pp", 1), ("dp", 1), ("tp", 2), ("ep", 3)),
    {
        "t0.w": ((2,), [(((0,), (1,)), [0, 3]), (((1,), (2,)), [1, 4])]),
        "t1.w": ((), [(((), ()), [0, 1, 2, 3, 4, 5])]),
    },
)


@given(shuffled_layouts())
@example((NINE, [0, 1, 2, 3, 8, 5, 6, 7, 4]))
@example((SIX, [0, 1, 2, 4, 3, 5]))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_same_layout_on_shuffled_devices_is_matched_back(case):
    ptc, order = case
    shuffled = _shuffled(ptc, order)
    matched = assign(ptc, shuffled)
    s = plan(ptc, matched).stats
    inner = ptc.mesh.axes[-1][1]
    if inner == 1 or _block(ptc.mesh) == inner:
        assert s.cross_host == 0  # every rank back on a host that holds all of its bytes
    else:
        # Hosts that do not fit whole groups of the innermost axis (tensor parallelism, by convention):
        # keeping groups whole comes first, and among the matchings that split no more groups than the
        # numbering the one with the fewest cross-host bytes is a bin packing the matcher does not
        # solve. So: all bytes back in place, or the numbering itself (never something in between).
        assert s.cross_host == 0 or matched == shuffled
    assert _split_groups(matched.mesh) <= _split_groups(shuffled.mesh)
    if len(set(ptc.mesh.hosts)) == ptc.mesh.size:  # one device per host: on a device that holds them
        assert s.kept == s.delivered


def test_a_tie_is_broken_towards_whole_groups():
    """Of two matchings that keep every byte in place, the one splitting fewer groups is taken."""
    shuffled = _shuffled(SIX, [0, 1, 2, 4, 3, 5])
    assert plan(SIX, shuffled).stats.cross_host > 0
    matched = assign(SIX, shuffled)
    assert plan(SIX, matched).stats.cross_host == 0
    assert _split_groups(matched.mesh) == _split_groups(SIX.mesh) == 1


def test_hypothesis_is_derandomized_under_ci():
    assert settings.default.derandomize == bool(os.environ.get("CI"))


@pytest.mark.parametrize("layout", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 4, 1)])
def test_a_gpt_layout_on_shuffled_devices_moves_nothing(layout):
    ptc = gpt_ptc(preset("tiny"), *layout, devices_per_host=4)
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    s = plan(ptc, assign(ptc, _shuffled(ptc, order))).stats
    assert s.kept == s.delivered and s.moved == 0


def test_growing_dp_keeps_each_pipeline_stage_on_its_hosts():
    cfg = preset("gpt3-2.7b")
    old = gpt_ptc(cfg, 1, 4, 2, devices_per_host=4)  # stage 0 on h0, stage 1 on h1
    fresh = [(device_id(h, d), f"h{h}") for h in (2, 3) for d in range(4)]
    numbered = gpt_ptc(cfg, 2, 4, 2, devices=[*zip(old.mesh.devices, old.mesh.hosts), *fresh])
    matched = assign(old, numbered)
    before, after = plan(old, numbered).stats, plan(old, matched).stats
    # numbering puts stage 0's second replica on h1: both stages cross; matched, only the new replicas do
    held = sum(s.box.volume * old.tensors[s.tensor].itemsize for s in old.all_shards())
    assert after.kept == held and before.kept < 0.6 * held  # every old device keeps all it holds
    assert after.cross_host == after.cross_host_lower_bound < 0.7 * before.cross_host
    for g in range(0, 16, 4):  # each tensor-parallel group stays on one host
        assert len(set(matched.mesh.hosts[g : g + 4])) == 1
    assert Counter(matched.mesh.hosts) == Counter(numbered.mesh.hosts)


def test_gpt3_175b_on_2048_devices_is_matched_in_seconds():
    """CPU seconds of this process, so that other jobs on a shared machine do not count."""
    cfg = preset("gpt3-175b")
    old, new = gpt_ptc(cfg, 8, 8, 16), gpt_ptc(cfg, 16, 8, 16)
    t = time.process_time()
    matched = assign(old, new)
    elapsed = time.process_time() - t
    assert elapsed < 5, elapsed
    assert plan(old, matched).stats.cross_host < 0.6 * plan(old, new).stats.cross_host
