"""Hosts die: loads come from surviving replicas, name what is lost, and fall back to the DCP snapshot."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import tenplex
from launch import run_ranks
from tenplex.store import start_store
from tenplex.transformer import DurableError, NoSnapshotError, ShapeMismatchError, StateError

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


def test_one_rank_failing_its_reads_fails_the_load_on_every_rank_before_any_write(results):
    for r in range(2):
        res = results[r]["one_rank_fails"]
        assert "r1/model.lin.weight" in res["raised"] and "corrupted" in res["raised"], res
        assert len(res["untouched"]) >= 7, res  # every tensor and the values still as built (zeros)
        assert res["source"] == "durable" and res["bad"] == [], res


def test_dp_replicas_on_a_surviving_host_serve_the_load(results):
    urls = results[-1]
    for r in range(2):
        res = results[r]["dp_replicas"]
        assert res.get("bad") == [], res
        assert res["lost"] == [urls["b"]]
        assert res["bytes"]["cross_host"] == 0


def test_store_replica_serves_a_stage_whose_host_died(results):
    urls = results[-1]
    for r in range(2):
        res = results[r]["store_replica"]
        assert res.get("bad") == [] and res["source"] == "memory", res
        assert res["lost"] == [urls["b"]] and res["replaced"] == {urls["b"]: urls["c"]}, res  # served by C


def test_lost_boxes_are_named_and_the_durable_snapshot_takes_over(results):
    for r in range(2):
        unrec = results[r]["unrecoverable"]
        assert "have no surviving copy" in unrec["message"], unrec
        names = {t for t, _ in unrec["boxes"]}
        assert "optim.state.lin.weight.exp_avg" in names  # a stage-1 tensor
        assert "model.emb.weight" not in names  # stage 0 survived on host A
        durable = results[r]["durable"]
        assert durable.get("bad") == [] and durable["source"] == "durable", durable


def _blob_file(c, job: str, step: int, name: str) -> tuple[str, int]:
    """The shared-memory file that holds a blob and the blob's offset in it (a pack holds many blobs):
    what a flipped bit in a host's memory corrupts."""
    blob = c.request("POST", f"/v1/jobs/{job}/versions/{step}/locate", {"names": [name]})["blobs"][0]
    return blob["path"], blob["offset"]


def _flip(where: tuple[str, int], offset: int) -> None:
    path, start = where
    offset += start
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def _state(fill: float | None = None) -> dict:
    """Two tensors over several checksum chunks (1 MiB each) and a value; `fill`: a target of sentinels."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(300_000, generator=g), torch.randn(4, 300_000, generator=g)
    if fill is not None:
        a, b = torch.full_like(a, fill), torch.full_like(b, fill)
    return {"a": a, "b": b, "step": 7 if fill is None else -1}


def test_a_corrupted_byte_fails_the_load_before_any_target_is_written(tmp_path):
    """One flipped byte near the end of `b` (the last tensor read): the load raises and `a` and `b` keep
    every sentinel (the reads used to land in the targets: `a` whole, `b` three quarters); with `path=`
    the persisted DCP snapshot serves the load instead."""
    source = _state()
    with start_store() as s:
        tenplex.save(source, job="flip", step=1, store=s.url)
        tenplex.persist("flip", 1, str(tmp_path / "dcp"), store=s.url)
        _flip(_blob_file(s.client(), "flip", 1, "r0/b"), 4 * 300_000 * 4 - 100)
        target = _state(fill=-5.0)
        with pytest.raises(StateError, match=r"corrupted"):
            tenplex.load(target, job="flip", store=s.url)
        assert torch.equal(target["a"], torch.full_like(target["a"], -5.0))
        assert torch.equal(target["b"], torch.full_like(target["b"], -5.0))
        assert target["step"] == -1
        info = tenplex.load(target, job="flip", store=s.url, path=str(tmp_path / "dcp"))
        assert info.source == "durable" and "failed" in info.note, info
        assert torch.equal(target["a"], source["a"]) and torch.equal(target["b"], source["b"])
        assert target["step"] == 7


def test_a_corrupted_newest_snapshot_gives_way_to_the_one_before():
    """Without `step`, a snapshot whose bytes fail their checksums is passed over for the newest one before
    it (named in `skipped`); a `step` asked for is never swapped for another; with every snapshot corrupted
    the first one's error is raised (never NoSnapshotError, after which a job would start over)."""
    older = _state()
    newer = {"a": older["a"] + 1, "b": older["b"] + 1, "step": 8}
    with start_store() as s:
        tenplex.save(older, job="rot", step=1, store=s.url)
        tenplex.save(newer, job="rot", step=2, store=s.url)
        _flip(_blob_file(s.client(), "rot", 2, "r0/b"), 4 * 300_000 * 4 - 100)
        target = _state(fill=-5.0)
        info = tenplex.load(target, job="rot", store=s.url)
        assert info.step == 1 and [x["step"] for x in info.skipped] == [2], info.skipped
        assert "corrupted" in info.skipped[0]["error"], info.skipped
        assert torch.equal(target["a"], older["a"]) and torch.equal(target["b"], older["b"])
        assert target["step"] == 7
        with pytest.raises(StateError, match=r"corrupted"):
            tenplex.load(_state(fill=-5.0), job="rot", step=2, store=s.url)
        _flip(_blob_file(s.client(), "rot", 1, "r0/a"), 17)
        with pytest.raises(StateError, match=r"step 2: .*corrupted") as e:
            tenplex.load(_state(fill=-5.0), job="rot", store=s.url)
        assert not isinstance(e.value, NoSnapshotError), e.value


def test_a_store_dying_mid_load_leaves_the_targets_or_falls_back(tmp_path, monkeypatch):
    """The store holding the snapshot is SIGKILLed after the plan, as the first read starts (read directly
    or relayed through this host's store): without `path=` the load raises with the targets untouched;
    with it, the DCP snapshot serves the load."""
    import tenplex.transformer.fetch as fetch

    reads = ("read_many", "hold_relayed_many")
    real = {name: getattr(fetch, name) for name in reads}
    source = _state()
    for fallback in (False, True):
        with start_store() as own, start_store() as old:
            tenplex.save(source, job="dies", step=1, store=old.url)
            tenplex.persist("dies", 1, str(tmp_path / f"dcp{fallback}"), store=old.url)

            def dying(read):
                def first_kills(requests, *args, **kwargs):
                    old.proc.send_signal(signal.SIGKILL)  # once: a process already reaped is not signalled
                    old.proc.wait()
                    return read(requests, *args, **kwargs)

                return first_kills

            for name in reads:
                monkeypatch.setattr(fetch, name, dying(real[name]))
            target = _state(fill=-5.0)
            kw = {"path": str(tmp_path / f"dcp{fallback}")} if fallback else {}
            if not fallback:
                with pytest.raises(StateError):
                    tenplex.load(target, job="dies", store=own.url, sources=[old.url], **kw)
                assert torch.equal(target["b"], torch.full_like(target["b"], -5.0)) and target["step"] == -1
                assert torch.equal(target["a"], torch.full_like(target["a"], -5.0))
            else:
                info = tenplex.load(target, job="dies", store=own.url, sources=[old.url], **kw)
                assert info.source == "durable" and torch.equal(target["b"], source["b"]), info
            for name in reads:
                monkeypatch.setattr(fetch, name, real[name])


def test_boxes_from_another_host_are_read_directly_or_relayed_or_scratched(monkeypatch):
    """A load that writes its targets once every box arrived (atomic) fetches a large box of another host's
    store into this host's store and holds it there (received into memory the store holds, not into
    scratch pages to fault in), or reads it into scratch when that store has no room for it; one that lands
    boxes in their targets (atomic=False) reads it straight from the source's store. Every way the bytes
    arrive whole, checked, and no relay copy is left."""
    import tenplex.transformer.fetch as fetch

    real_scratch, real_hold, scratched, held = fetch._into_scratch, fetch.hold_relayed_many, [], []

    def scratch_spy(*args, **kwargs):
        scratched.append(len(args[0]))
        return real_scratch(*args, **kwargs)

    def hold_spy(requests, *args, **kwargs):
        held.append(len(requests))
        return real_hold(requests, *args, **kwargs)

    monkeypatch.setattr(fetch, "_into_scratch", scratch_spy)
    monkeypatch.setattr(fetch, "hold_relayed_many", hold_spy)
    source = _state()
    ways = ((True, "64MiB", "held"), (False, "64MiB", "direct"), (True, "1MiB", "scratch"))
    for atomic, limit, expect in ways:
        scratched.clear()
        held.clear()
        with start_store() as old, start_store(memory_limit=limit) as own:
            monkeypatch.setenv("TENPLEX_EMULATED_HOSTS", "1")
            monkeypatch.setenv("TENPLEX_STORE", own.url)
            tenplex.save(source, job="far", step=1, store=old.url)
            target = _state(fill=-5.0)
            info = tenplex.load(target, job="far", store=own.url, sources=[old.url], atomic=atomic)
            assert torch.equal(target["a"], source["a"]) and torch.equal(target["b"], source["b"])
            assert target["step"] == 7 and info.bytes["cross_host"] == 4 * 5 * 300_000, info.bytes
            got = "scratch" if scratched else "held" if held else "direct"
            assert got == expect, (atomic, limit, scratched, held)
            assert ("network_reads" in info.phases) == (expect == "direct"), info.phases
            # the lowest rank drops the relay cache without waiting for the answer: it goes at once
            deadline = time.monotonic() + 10
            while own.client().stats()["relay_blobs"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert own.client().stats()["relay_blobs"] == 0


def test_a_blob_whose_shape_differs_from_its_piece_is_refused():
    """A blob replaced by one of another shape that still contains every box read (a foreign save's)
    must not be read as the snapshot's piece."""
    with start_store() as s:
        tenplex.save({"w": torch.arange(12.0)}, job="shape", step=1, store=s.url)
        c = s.client()
        manifest = c.manifest("shape", 1)
        c.create_version("shape", 2)
        c.write_blob("shape", 2, "r0/w", torch.arange(24.0).numpy())
        c.commit("shape", 2, {**manifest, "step": 2})
        target = {"w": torch.zeros(12)}
        with pytest.raises(StateError, match=r"float32\[24\].*float32\[12\]"):
            tenplex.load(target, job="shape", store=s.url)
        assert torch.equal(target["w"], torch.zeros(12))


def test_the_durable_fallback_does_not_cast_dtypes(tmp_path):
    """The memory path raises for a float64 target of a float32 snapshot; DCP would cast silently."""
    with start_store() as s:
        tenplex.save({"w": torch.arange(6.0)}, job="cast", step=1, store=s.url)
        tenplex.persist("cast", 1, str(tmp_path / "dcp"), store=s.url)
        target = {"w": torch.zeros(6, dtype=torch.float64)}
        with pytest.raises(ShapeMismatchError, match=r"float32\[6\] in the snapshot but float64\[6\]"):
            tenplex.load(target, job="cast", store=s.url)
    with start_store() as empty:
        with pytest.raises(ShapeMismatchError, match=r"float32\[6\] in .* but float64\[6\]"):
            tenplex.load(target, job="cast", store=empty.url, path=str(tmp_path / "dcp"))
        assert torch.equal(target["w"], torch.zeros(6, dtype=torch.float64))


def test_a_torn_durable_snapshot_raises_before_any_target_is_written(tmp_path):
    """A checkpoint whose data file lost its tail (a persist cut short, a full disk): the fallback raises a
    TenplexError (DCP's own CheckpointException is a BaseException) and every target keeps its values."""
    path = tmp_path / "dcp"
    with start_store() as s:
        state = {"a": torch.arange(4096.0), "b": torch.arange(4096.0) * 2, "c": torch.ones(4096)}
        tenplex.save(state, job="torn", step=3, store=s.url)
        tenplex.persist("torn", 3, str(path), store=s.url)
    data = max((p for p in path.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    target = {k: torch.full((4096,), -1.0) for k in ("a", "b", "c")}
    with start_store() as empty, pytest.raises(DurableError, match="persisted snapshot"):
        tenplex.load(target, job="torn", store=empty.url, path=str(path))
    assert all(torch.equal(t, torch.full((4096,), -1.0)) for t in target.values())


def test_a_failed_persist_leaves_the_checkpoint_before_it(tmp_path, monkeypatch):
    """persist writes beside the path and swaps it in whole: one that fails midway (here: the writer raises
    after its first file) leaves the previous checkpoint readable, and a TenplexError."""
    from torch.distributed.checkpoint import FileSystemWriter

    path = tmp_path / "dcp"
    with start_store() as s:
        tenplex.save({"w": torch.arange(6.0)}, job="swap", step=1, store=s.url)
        tenplex.persist("swap", 1, str(path), store=s.url)
        tenplex.save({"w": torch.arange(6.0) + 10}, job="swap", step=2, store=s.url)

        def broken(self, *args, **kwargs):
            raise OSError("No space left on device")

        with monkeypatch.context() as m, pytest.raises(DurableError, match="No space left"):
            m.setattr(FileSystemWriter, "write_data", broken)
            tenplex.persist("swap", 2, str(path), store=s.url)
    assert [p.name for p in tmp_path.iterdir()] == ["dcp"]  # nothing half-written left beside it
    target = {"w": torch.zeros(6)}
    with start_store() as empty:
        info = tenplex.load(target, job="swap", store=empty.url, path=str(path))
    assert info.step == 1 and torch.equal(target["w"], torch.arange(6.0))


def test_a_load_not_atomic_lands_boxes_in_their_targets_and_falls_back_whole(monkeypatch):
    """`atomic=False`: the boxes of another host's store land in the targets themselves (no scratch the size
    of the state); a corrupted newest snapshot then gives way to the one before, every byte of which ends in
    the targets, whatever the corrupted one wrote first; asked for the corrupted step, the load raises."""
    import tenplex.transformer.fetch as fetch

    sizes = []

    class ArenaSpy(fetch.Arena):
        def __init__(self, capacity: int) -> None:
            sizes.append(capacity)
            super().__init__(capacity)

    monkeypatch.setattr(fetch, "Arena", ArenaSpy)
    monkeypatch.setenv("TENPLEX_EMULATED_HOSTS", "1")
    older = _state()
    newer = {"a": older["a"] + 1, "b": older["b"] + 1, "step": 8}
    state_bytes = 5 * 300_000 * 4
    with start_store() as old, start_store() as own:
        tenplex.save(older, job="direct", step=1, store=old.url)
        tenplex.save(newer, job="direct", step=2, store=old.url)
        for atomic in (True, False):
            sizes.clear()
            target = _state(fill=-5.0)
            info = tenplex.load(target, job="direct", store=own.url, sources=[old.url], atomic=atomic)
            assert info.step == 2 and info.bytes["cross_host"] == state_bytes, info.bytes
            assert torch.equal(target["a"], newer["a"]) and torch.equal(target["b"], newer["b"])
            assert target["step"] == 8
            assert (sum(sizes) >= state_bytes) == atomic, (atomic, sizes)
        _flip(_blob_file(old.client(), "direct", 2, "r0/b"), 4 * 300_000 * 4 - 100)
        target = _state(fill=-5.0)
        info = tenplex.load(target, job="direct", store=own.url, sources=[old.url], atomic=False)
        assert info.step == 1 and [x["step"] for x in info.skipped] == [2], info.skipped
        assert torch.equal(target["a"], older["a"]) and torch.equal(target["b"], older["b"])
        assert target["step"] == 7
        target = _state(fill=-5.0)
        with pytest.raises(StateError, match=r"corrupted"):
            tenplex.load(target, job="direct", step=2, store=own.url, sources=[old.url], atomic=False)
        assert torch.equal(target["a"], newer["a"])  # it landed in the target itself before `b` failed
        with pytest.raises(StateError, match=r"corrupted"):  # the one before may lack what it part wrote
            tenplex.load(
                _state(fill=-5.0), job="direct", store=own.url, sources=[old.url], atomic=False, strict=False
            )
