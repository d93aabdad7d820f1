"""tenplex.dcp: DCP saves on 4 ranks (FSDP2 + TP) and loads on 3 (uneven FSDP2, no TP) through the stores,
bit for bit equal to DCP through the file system, through both front doors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from launch import on_two_hosts
from tenplex.dcp import StoreReader, StoreWriter, location
from tenplex.ptc import Box
from tenplex.store import BadRequestError, ChecksumError, start_store
from tenplex.transformer import StateError

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results():
    with on_two_hosts("dcp_cases", 300, {"DCP_TEST_STORES": "{a},{b}"}) as got:
        yield got


def test_ranks_ran(results):
    for r, res in enumerate(results):
        assert res.get("ok"), f"rank {r}: {res.get('error')}"


def test_source_is_fsdp2_over_tp(results):
    assert any("_StridedShard" in p for p in results[0]["placements"]), results[0]["placements"]


@pytest.mark.parametrize("case", ["dcp->dcp", "tenplex.save->dcp", "dcp->tenplex.load", "async_save->dcp"])
def test_four_ranks_to_three_bit_for_bit(results, case):
    for r in range(3):
        assert results[r]["cases"][case] == [], (r, results[r]["cases"][case])


def test_newest_complete_step_is_read(results):
    assert results[0]["chosen"] == 10


def test_no_snapshot_is_the_tenplex_error(results):
    for r in range(3):
        assert results[r]["missing"] == ["NoSnapshotError"]
        assert "no committed version of job 'never'" in results[r]["missing_msg"]


def test_ranges_two_ranks_need_from_another_host_are_relayed_once_and_freed(results):
    for r in range(2):
        res = results[r]["relay"]
        assert res["equal"] and res["relayed"] > 0 and res["left"] == 0, res


def test_store_reader_and_tenplex_load_make_the_same_plan(results):
    """Same snapshot, same target layout: every rank runs the same reads through both doors (the planner's
    source policy: own device, a replica on its host, one sender per host and box, relayed to the host's
    other rank), and both fill the same bytes."""
    routes = set()
    for r, res in enumerate(results):
        got = res["same_plan"]
        assert got["load"] and got["dcp"] == got["load"], (r, got["dcp"], got["load"])
        assert got["equal"], r
        routes.update(read[4] for read in got["load"])
    assert routes == {"kept", "same_host", "cross_host", "relayed"}, routes


# ---------------------------------------------------------------- one process, real stores


def _save(sd, writer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)


def _load(sd, reader):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader, no_dist=True)


def _cause(e: CheckpointException) -> BaseException:
    return next(iter(e.failures.values()))[0]


def test_a_torn_dcp_save_is_never_read():
    """Step 2 committed on store A but not on B (the coordinator died between commits): step 1 is read."""
    with start_store() as a, start_store() as b:
        _save({"w": torch.ones(5), "n": 1}, StoreWriter("torn", 1, store=a.url))
        _save({"w": torch.full((5,), 2.0), "n": 2}, StoreWriter("torn", 2, store=a.url))
        ca, cb = a.client(), b.client()
        torn = {**ca.manifest("torn", 2), "stores": [a.url, b.url]}
        blobs = [x["name"] for x in ca.blobs("torn", 2)]
        ca.delete_version("torn", 2)
        for name in blobs:  # the same blobs again, committed on A only
            ca.write_blob("torn", 2, name, torch.full((5,), 2.0).numpy() if name.endswith("w") else
                          torch.zeros(0, dtype=torch.uint8).numpy())  # fmt: skip
        ca.commit("torn", 2, torn)
        cb.create_version("torn", 2)
        got = {"w": torch.zeros(5), "n": 0}
        reader = StoreReader("torn", store=a.url, sources=[b.url])
        _load(got, reader)
        assert reader.chosen_step == 1 and torch.equal(got["w"], torch.ones(5)) and got["n"] == 1


def test_a_corrupted_range_raises_and_the_target_keeps_nothing_foreign():
    with start_store() as a:
        w = torch.arange(3 << 18, dtype=torch.float32)  # 3 MiB: three checksum chunks
        _save({"w": w}, StoreWriter("bad", 1, store=a.url))
        c = a.client(local=True)
        blob = c.request("POST", "/v1/jobs/bad/versions/1/locate", {"names": ["r0/w"]})["blobs"][0]
        at = blob["offset"] + (1 << 20) + 7  # a blob's bytes start at its offset in the file (a pack's)
        with open(blob["path"], "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(CheckpointException) as e:
            _load({"w": torch.zeros_like(w)}, StoreReader("bad", store=a.url))
        assert isinstance(_cause(e.value), StateError)
        assert isinstance(_cause(e.value).__cause__, ChecksumError)


def test_checkpoint_id_is_a_location_and_bad_names_are_refused(tmp_path):
    with start_store() as a:
        w = StoreWriter("ids", 1, store=a.url)
        _save({"w": torch.ones(2)}, w)
        for run, value in (("run1", 3.0), ("run2", 4.0)):  # two runs' step-30 folders: two snapshots
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save({"w": torch.full((2,), value)}, checkpoint_id=tmp_path / run / "step-30",
                         storage_writer=w, no_dist=True)  # fmt: skip
        job1, step = location(tmp_path / "run1" / "step-30")
        assert step == 30 and job1 != location(tmp_path / "run2" / "step-30")[0]
        assert location(tmp_path / "run1" / "step-31")[0] == job1  # the run's steps are one job
        assert a.client().versions("ids") == [1] and a.client().versions(job1) == [30]
        got = {"w": torch.zeros(2)}
        _load(got, StoreReader(checkpoint_id=tmp_path / "run1" / "step-30", store=a.url))
        assert torch.equal(got["w"], torch.full((2,), 3.0))
        plain = tmp_path / "latest"  # a folder not ending in a number is step 0 of its own job
        _save({"w": torch.full((2,), 5.0)}, StoreWriter(checkpoint_id=plain, store=a.url))
        assert location(plain)[1] == 0 and location(plain)[0] != location(tmp_path / "latest0")[0]
        _load(got, StoreReader(checkpoint_id=str(plain) + "/", store=a.url))
        assert torch.equal(got["w"], torch.full((2,), 5.0))
        # the metadata names the save as DCP's file system does: the path it was given, its save id
        writer, reader = (
            StoreWriter(checkpoint_id=plain, store=a.url),
            StoreReader(checkpoint_id=plain, store=a.url),
        )
        _save({"w": torch.ones(2)}, writer)
        meta = reader.read_metadata().storage_meta
        assert (meta.checkpoint_id, meta.save_id, meta.load_id) == (
            str(plain),
            writer.save_id,
            reader.load_id,
        )
        assert StoreReader("ids", 1, store=a.url).read_metadata().storage_meta.checkpoint_id == "ids@1"
    with pytest.raises(BadRequestError, match="invalid job name"):
        StoreWriter("a/b", 1)
    with pytest.raises(BadRequestError, match="invalid version"):
        StoreReader("job", -1)


def test_overwrite_false_raises_as_dcp_does_and_keeps_the_save():
    with start_store() as a:
        _save({"w": torch.ones(2)}, StoreWriter("ow", 1, store=a.url))
        with pytest.raises(CheckpointException, match="already exists and overwrite=False"):
            _save({"w": torch.zeros(2)}, StoreWriter("ow", 1, store=a.url, overwrite=False))
        got = {"w": torch.zeros(2)}
        _load(got, StoreReader("ow", 1, store=a.url))
        assert torch.equal(got["w"], torch.ones(2))


def test_a_snapshot_loads_into_another_dtype_as_dcp_converts():
    with start_store() as a:
        w = torch.rand(4, 3)
        _save({"w": w}, StoreWriter("conv", 1, store=a.url))
        got = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
        _load(got, StoreReader("conv", store=a.url))
        assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.to(torch.bfloat16))


def test_dcp_stream_transforms_are_taken_and_the_bytes_kept_as_written():
    from torch.distributed.checkpoint._extension import ZStandard

    with start_store() as a:
        w = torch.rand(4, 3)
        _save({"w": w, "n": [1, 2]}, StoreWriter("ext", 1, store=a.url, _extensions=[ZStandard()]))
        got = {"w": torch.zeros(4, 3), "n": []}
        _load(got, StoreReader("ext", store=a.url))
        assert torch.equal(got["w"], w) and got["n"] == [1, 2]
        out = np.empty((2, 3), np.float32)  # rows 1-2 of the blob: the stored bytes are the tensor's own
        a.client().read_box("ext", 1, "r0/w", Box((1, 0), (3, 3)), out)
        assert np.array_equal(out, w[1:3].numpy())


DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu, torch.complex32, torch.complex64, torch.complex128, torch.uint16,
          torch.uint32, torch.uint64, torch.bfloat16, torch.bool]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_torch_checkpoints_round_trips_bit_for_bit(dtype):
    raw = torch.randint(0, 255, (6, 4 * dtype.itemsize), dtype=torch.uint8)
    w = raw.view(dtype) if dtype != torch.bool else raw.bool()
    with start_store() as a:
        _save({"w": w}, StoreWriter("dt", 1, store=a.url))
        got = {"w": torch.zeros_like(w)}
        _load(got, StoreReader("dt", store=a.url))
        assert torch.equal(got["w"].view(torch.uint8), w.view(torch.uint8))


def test_planner_data_is_kept_so_conversion_and_loads_by_key_work(tmp_path):
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    sd = {"model": {"net": {"w": torch.rand(3), "b": torch.rand(2)}}, "step": 4}
    with start_store() as a:
        _save(sd, StoreWriter(checkpoint_id=tmp_path / "step-4", store=a.url))
        reader = StoreReader(checkpoint_id=tmp_path / "step-4", store=a.url)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _load_state_dict_from_keys("model", storage_reader=reader)
        assert torch.equal(got["model"]["net"]["w"], sd["model"]["net"]["w"]) and "step" not in got
        meta = StoreReader(checkpoint_id=tmp_path / "step-4", store=a.url).read_metadata()
        assert meta.planner_data["model.net.w"] == ("model", "net", "w")
