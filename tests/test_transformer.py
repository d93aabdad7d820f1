"""save in layout A, load in layout B, over real stores and a real 4-rank gloo world; bitwise checks."""

from __future__ import annotations

import pytest

from launch import on_two_hosts
from tenplex.store import start_store
from transformer_cases import PAIRS

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results():
    with on_two_hosts("transformer_cases", 900) as got:
        yield got


@pytest.mark.parametrize("pair", [f"{a}->{b}" for a, b in PAIRS])
def test_reshard_bit_for_bit_and_round_trip(results, pair):
    for r, res in enumerate(results):
        assert res["pairs"][pair]["bad"] == [], f"rank {r}: {res['pairs'][pair]['bad']}"


def test_bytes_are_accounted_by_route(results):
    same = results[0]["pairs"]["dp2tp2->dp2tp2"]["bytes"]
    assert same["kept"] > 0 and same["cross_host"] == same["same_host"] == 0
    grow = [r["pairs"]["1->dp4"]["bytes"] for r in results]
    assert grow[0]["kept"] > 0  # rank 0 keeps its device
    assert all(g["cross_host"] + g["relayed"] > 0 for g in grow[2:])  # host B pulls from host A


def test_foreign_module_from_2x2_mesh_onto_3_ranks(results):
    for r in range(3):
        assert results[r]["foreign"]["bad"] == [], results[r]["foreign"]


def test_clear_errors_and_nothing_overwritten(results):
    for r in range(2):
        e = results[r]["errors"]
        assert "in the snapshot but not in the target" not in e["strict"]
        assert "missing in the snapshot: model.unknown.weight" in e["strict"]
        assert e["untouched"] == 0.0
        assert e["nonstrict_missing"] == ["model.unknown.weight"]
        assert "'model.lin.bias' is float32[7] in the snapshot but float32[8] in the target" in e["shape"]
        assert "no committed version of job 'never-saved'" in e["nosnapshot"]


def test_async_save_then_central_load(results):
    for r, res in enumerate(results):
        assert res["modes"]["done"] and res["modes"]["bad"] == [], (r, res["modes"])
        assert set(res["modes"]["bytes"]) == {"central"} and res["modes"]["bytes"]["central"] > 0


def test_strided_fsdp_over_tp_dtensors_load_bit_for_bit_and_interleaved_ones_are_refused(results):
    for r, res in enumerate(results):
        assert res["strided"]["bad"] == [], (r, res["strided"])
        assert "not one contiguous range" in res["strided"]["interleaved"], res["strided"]


def test_the_breakdown_accounts_for_the_save_and_the_load():
    """SaveHandle.phases and LoadInfo.phases name where the time went and add up to no more than it."""
    import torch

    import tenplex

    with start_store() as s:
        state = {"w": torch.randn(64, 64), "b": torch.randn(64), "step": 3}
        handle = tenplex.save(state, job="breakdown", step=1, store=s.url)
        assert {"describe", "gather", "plan", "stage", "create", "copy", "barrier", "commit"} <= set(
            handle.phases
        )
        target = {"w": torch.zeros(64, 64), "b": torch.zeros(64), "step": 0}
        info = tenplex.load(target, job="breakdown", store=s.url)
        sequential = [
            "describe",
            "gather",
            "plan",
            "choose",
            "reads",
            "barrier",
            "write",
            "restore",
        ]
        assert {"describe", "gather", "choose", "plan", "reads", "shm_reads", "write"} <= set(info.phases)
        assert all(v >= 0 for v in info.phases.values())
        assert sum(info.phases.get(k, 0.0) for k in sequential) <= info.seconds
        assert info.phases["shm_reads"] <= info.phases["reads"]


def test_periodic_saves_of_an_unchanged_layout_reuse_it_and_a_changed_one_is_built_again():
    """The second save of the same layout neither gathers the descriptions again nor plans (no "plan"
    phase), yet commits its own values; a tensor more is a new layout, planned and loaded right."""
    import torch

    import tenplex

    with start_store() as s:
        w = torch.randn(8, 4)
        first = tenplex.save({"w": w, "step": 1}, job="periodic", step=1, store=s.url)
        again = tenplex.save({"w": w + 1, "step": 2}, job="periodic", step=2, store=s.url)
        assert "plan" in first.phases and "plan" not in again.phases, (first.phases, again.phases)
        target = {"w": torch.zeros(8, 4), "step": 0}
        tenplex.load(target, job="periodic", store=s.url)
        assert target["step"] == 2 and torch.equal(target["w"], w + 1)
        grown = tenplex.save({"w": w + 2, "b": torch.ones(3), "step": 3}, job="periodic", step=3, store=s.url)
        assert "plan" in grown.phases
        target = {"w": torch.zeros(8, 4), "b": torch.zeros(3), "step": 0}
        tenplex.load(target, job="periodic", store=s.url)
        assert (
            target["step"] == 3
            and torch.equal(target["w"], w + 2)
            and torch.equal(target["b"], torch.ones(3))
        )


def test_a_cached_layout_names_what_each_rank_writes():
    """The layout cache serves every rank of the layout: a process that held rank 0 when the layout was
    first seen and holds rank 1 in a later save (a standby process, identical shards) writes rank 1's
    tensors, not the ones it wrote before."""
    from tenplex.transformer.gathered import LAYOUTS, RankShards, build_ptc, writers

    def rank(r: int) -> RankShards:
        own = {"a": ((4,), "float32", ((0,), (4,)))} if r == 0 else {"b": ((4,), "float32", ((0,), (4,)))}
        return RankShards(r, "http://h0", f"d{r}", {"shared": ((2,), "float32", ((0,), (2,))), **own})

    found = LAYOUTS.put("test-key", writers(build_ptc([rank(0), rank(1)])))
    try:
        assert found.mine(0) == {"a", "shared"}
        assert found.mine(1) == {"b"}  # one copy of "shared" per host: rank 0 writes it
        assert found.mine(0) == {"a", "shared"}
    finally:
        LAYOUTS.pop("test-key")


SHARD_BOXES = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore
from tenplex.transformer.shards import local_shard

for rank in (1, 2, 3, 1):  # one process holding another rank of an equal mesh, as a standby process does
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"), _init_backend=False)
    layouts = (((10, 6), [Shard(0), Shard(1)]), ((10, 6), [Shard(1), Shard(0)]), ((3,), [Shard(0), Shard(0)]))
    for shape, pl in layouts:
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, pl)
        t = DTensor.from_local(torch.zeros(local_shape), mesh, pl, run_check=False, shape=torch.Size(shape),
                               stride=torch.empty(shape, device="meta").stride())
        box = local_shard("w", t).box
        want = tuple(min(o, n) for o, n in zip(offset, shape))
        assert box.start == want and box.shape == tuple(local_shape), (rank, shape, pl, box, offset)
    dist.destroy_process_group()
print("ok")
"""


def test_a_shards_box_follows_the_rank_of_the_process_whatever_meshes_it_saw_before():
    """A shard's offset is computed once per layout and cached: a process that later holds another rank of
    an equal mesh must get that rank's box, uneven shards included (torch's computation is the reference)."""
    import os
    import subprocess
    import sys

    from launch import SRC

    r = subprocess.run([sys.executable, "-c", SHARD_BOXES], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(SRC)))  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_all_gather_matches_torchs_for_objects_in_and_beyond_a_slot(results):
    for r, res in enumerate(results):
        assert res["gather"]["world"] == [True] * 4, (r, res["gather"])
        assert res["gather"]["group"] == ([True] * 4 if r < 3 else []), (r, res["gather"])
        assert res["gather"]["then"] == [True] * 4 and res["gather"]["broadcast"] == [True] * 4, res["gather"]
        assert res["gather"]["raised"] == "division by zero"  # rank 0's exception, raised on every rank
