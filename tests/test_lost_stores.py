"""A store that cannot answer for a save is a lost store, never an empty one (docs/consistency.md, "not
there" and fresh starts): restarted, unreachable and squatted stores, against live daemons, with a
snapshot saved by two real dp ranks (each store holds a full copy)."""

from __future__ import annotations

import pytest
import torch

import tenplex
from launch import run_ranks
from rawhttp import Squatter
from tenplex.store import start_store
from tenplex.transformer import NoSnapshotError, StoresLostError, jobrecord
from transformer_cases import NAMES, TENSORS, global_tensor


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _target() -> dict:
    """The saved state as plain full tensors in this process (a one-rank layout: no process group)."""
    sd: dict = {"model": {}, "optim": {"state": {"lin.weight": {}}}, "buffers": {}}
    for name in NAMES:
        shape, dtype = TENSORS[name]
        parts = name.split(".")
        where = sd["optim"]["state"]["lin.weight"] if parts[0] == "optim" else sd[parts[0]]
        where[parts[-1] if parts[0] == "optim" else ".".join(parts[1:])] = torch.full(shape, 7).to(dtype)
    sd["step"], sd["meta"] = 0, {"betas": None, "tags": None}
    return sd


def check(sd: dict, salt: int) -> list[str]:
    """The names whose tensors differ from those saved with `salt`, bit for bit."""
    flat = dict(zip(NAMES, _leaves(sd)))
    return [n for n in NAMES if not torch.equal(flat[n], global_tensor(n, salt))] + (
        [] if sd["step"] == 100 + salt else ["step"]
    )


def _load(job: str, urls: list[str]):
    target = _target()
    info = tenplex.load(target, job=job, store=urls[0], sources=urls)
    return info, target


def test_restarted_unreachable_and_squatted_stores_are_lost_never_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("TENPLEX_STATE_DIR", str(tmp_path / "jobs"))
    a, b = start_store(), start_store()
    stores = [a, b]
    squatter = None
    try:
        run_ranks("lost_store_cases", 2, per_rank_env=[{"TENPLEX_STORE": s.url} for s in stores])
        urls = [a.url, b.url]
        info, target = _load("lost", urls)
        assert info.step == 20 and check(target, 20) == [] and info.lost_stores == []

        # a job deleted on purpose: every store answers, in the incarnation that held it: a fresh start
        for s in stores:
            s.client().delete_job("gone")
        with pytest.raises(NoSnapshotError):
            _load("gone", urls)

        # B restarts empty on its port: the newest snapshot comes from A, and B is named as restarted
        b.kill()
        b = stores[1] = start_store(port=_port(urls[1]))
        info, target = _load("lost", urls)
        assert info.step == 20 and check(target, 20) == []
        assert info.lost_stores == [urls[1]] and info.lost_why[urls[1]].startswith("restarted")

        # A unreachable too: no complete snapshot answers, and that is not "no snapshot"
        a.kill()
        before = _target()
        target = _target()
        with pytest.raises(StoresLostError) as e:
            tenplex.load(target, job="lost", store=urls[1], sources=urls)
        assert set(e.value.lost) == set(urls) and e.value.lost[urls[0]].startswith("unreachable")
        assert e.value.lost[urls[1]].startswith("restarted")
        assert all(torch.equal(x, y) for x, y in zip(_leaves(target), _leaves(before)))  # nothing written

        # another process took A's port: what it answers is not the store's answer
        squatter = Squatter(_port(urls[0]))
        with pytest.raises(StoresLostError) as e:
            _load("lost", urls)
        assert urls[0] in e.value.lost
        squatter.close()
        squatter = None

        # both restarted empty: only the job's record says it had a snapshot there, and that is enough
        a = stores[0] = start_store(port=_port(urls[0]))
        with pytest.raises(StoresLostError) as e:
            _load("lost", urls)
        assert set(e.value.lost) == set(urls)
        assert all(why.startswith("restarted") for why in e.value.lost.values())
        assert "--fresh" in str(e.value)

        # without the record (another host, or forgotten on purpose) every store's answer is explicit
        jobrecord.forget("lost")
        with pytest.raises(NoSnapshotError):
            _load("lost", urls)
    finally:
        if squatter is not None:
            squatter.close()
        for s in stores:
            s.stop()


def _leaves(sd: dict) -> list[torch.Tensor]:
    """The tensors of `sd` in the order of NAMES (buffers, model, optim: sorted like the names)."""
    flat = {f"model.{k}": v for k, v in sd["model"].items()} | {
        f"buffers.{k}": v for k, v in sd["buffers"].items()
    }
    flat |= {f"optim.state.lin.weight.{k}": v for k, v in sd["optim"]["state"]["lin.weight"].items()}
    return [flat[n] for n in NAMES]


def test_a_save_torn_by_a_hosts_death_gives_way_to_the_one_before(tmp_path, monkeypatch):
    """Step 20's copy of B's shards never reached A (B died during its push), then B is lost: step 20 reads
    as complete (B cannot answer, so it may hold it) but its B pieces have no copy; the load passes it over
    for step 10, whose copy A holds, and says so (`skipped`) — never a fresh start, never foreign bytes."""
    monkeypatch.setenv("TENPLEX_STATE_DIR", str(tmp_path / "jobs"))
    a, b = start_store(), start_store()
    try:
        for s in (a, b):
            s.client().set_peers([a.url, b.url], 1)
        env = {"TENPLEX_TEST_CASE": "torn", "TENPLEX_EMULATED_HOSTS": "1"}
        run_ranks("lost_store_cases", 2, env=env, per_rank_env=[{"TENPLEX_STORE": s.url} for s in (a, b)])
        save_id = b.client().save_ids("torn")[20]
        assert a.client().delete_copy("torn", 20, b.url, save_id)  # the push that did not finish
        b.kill()
        info, target = _load("torn", [a.url, b.url])
        assert info.step == 10 and check(target, 10) == [], (info.step, check(target, 10))
        assert [x["step"] for x in info.skipped] == [20] and "no surviving copy" in info.skipped[0]["error"]
        assert info.lost_stores == [b.url] and info.replaced == {b.url: a.url}
        with pytest.raises(tenplex.transformer.UnrecoverableError):  # asked for step 20: no other answer
            tenplex.load(_target(), job="torn", step=20, store=a.url, sources=[a.url, b.url])
    finally:
        a.stop()
        b.stop()


def test_a_broken_process_group_is_a_tenplex_error():
    """A rank that is gone mid-save: the others get GroupError (a TenplexError naming the collective), not
    gloo's RuntimeError from deep inside."""
    with start_store() as s:
        out = run_ranks("lost_store_cases", 2, env={"TENPLEX_STORE": s.url, "TENPLEX_TEST_CASE": "peer-dies"})
    assert out[1] == {"left": True}
    assert out[0]["error"] == "GroupError", out[0]
    assert "process group broke during" in out[0]["message"]


def test_the_records_stores_are_searched_wherever_the_job_moved():
    """The job's newest save is on store A; the job comes back on a new, empty store B without naming A:
    the record's stores are searched too, so the save is found there, not taken for a fresh start."""
    with start_store() as a, start_store() as b:
        state = {"w": torch.arange(6.0)}
        tenplex.save(state, job="moved", step=4, store=a.url)
        target = {"w": torch.zeros(6)}
        info = tenplex.load(target, job="moved", store=b.url, sources=[])
        assert info.step == 4 and torch.equal(target["w"], state["w"])


def test_a_loopback_url_is_a_stores_own_only_for_a_connection_that_arrived_on_loopback():
    """A listener on a dead store's port on host A must not borrow the proof of a store on host B for
    A's loopback URL: B answers for a loopback URL only on a connection that arrived on loopback."""
    from tenplex.store.auth import is_own_url

    for url in ("http://127.0.0.1:7311", "http://localhost:7311", "http://[::1]:7311"):
        assert is_own_url(url, "http://hostb:7311", 7311, "0.0.0.0", arrived="127.0.0.1")
        assert not is_own_url(url, "http://hostb:7311", 7311, "0.0.0.0", arrived="10.77.0.3")
        assert not is_own_url(url, "http://hostb:7311", 7311, "::", arrived="::ffff:10.77.0.3")
    assert is_own_url("http://hostb:7311", "http://hostb:7311", 7311, "0.0.0.0", arrived="10.77.0.3")
