"""tenplex.dcp: DCP saves on 4 ranks (FSDP2 + TP) and loads on 3 (uneven FSDP2, no TP) through the stores,
bit for bit equal to DCP through the file system, through both front doors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from launch import on_two_hosts
from tenplex.dcp import StoreReader, StoreWriter
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


def test_dtype_mismatch_is_named_and_nothing_is_read():
    with start_store() as a:
        _save({"w": torch.ones(4)}, StoreWriter("dt", 1, store=a.url))
        target = {"w": torch.zeros(4, dtype=torch.float64)}
        with pytest.raises(CheckpointException) as e:
            _load(target, StoreReader("dt", store=a.url))
        assert "'w' is float32 in the snapshot but torch.float64 in the target" in str(_cause(e.value))
        assert not target["w"].any()


def test_checkpoint_id_names_the_step_and_bad_names_are_refused():
    with start_store() as a:
        w = StoreWriter("ids", 1, store=a.url)
        _save({"w": torch.ones(2)}, w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.full((2,), 3.0)}, checkpoint_id="outputs/checkpoint/step-30",
                     storage_writer=w, no_dist=True)  # fmt: skip
        assert a.client().versions("ids") == [1, 30]
        got = {"w": torch.zeros(2)}
        _load(got, StoreReader("ids", store=a.url))
        assert torch.equal(got["w"], torch.full((2,), 3.0))
        with pytest.raises(StateError, match="names no step"):
            w.reset("latest")
    with pytest.raises(BadRequestError, match="invalid job name"):
        StoreWriter("a/b", 1)
    with pytest.raises(BadRequestError, match="invalid version"):
        StoreReader("job", -1)
