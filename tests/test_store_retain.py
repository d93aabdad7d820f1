"""Retention never deletes the newest complete save, copies obey it too, and every write is bound to its
save: a stale writer, a push racing a delete, a relay fetch racing a drop are refused or freed.

Every test runs real daemons over real sockets (see docs/consistency.md).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

import tenplex
from tenplex.ptc import Box
from tenplex.store import ConflictError, NotFoundError, StoreClient, start_store

pytestmark = pytest.mark.timeout(180)


def _commit_by_hand(ca: StoreClient, cb: StoreClient, template: dict, step: int, sid: str, model, on: str):
    """Save `model` as `step` (save `sid`) with its blobs on A and an empty part on B, as a two-store save
    does; commit it on `on` ("a", "b" or "ab": where the committer got before it died)."""
    manifest = {**template, "step": step, "save_id": sid, "stores": [ca.url, cb.url]}
    ca.create_version("roll", step, save_id=sid)
    for k, v in sorted(model.state_dict().items()):
        ca.write_blob("roll", step, f"r0/model.{k}", v.detach().numpy(), save_id=sid)
    cb.create_version("roll", step, save_id=sid)
    for c, key in ((ca, "a"), (cb, "b")):
        if key in on:
            c.commit("roll", step, manifest)
    return manifest


def test_a_rollback_after_a_partial_commit_keeps_the_complete_snapshot():
    """Step 20 committed on B only (the committer died), then the job rolls back and saves step 15 with
    keep=1: both stores must keep 15 (the newest complete save, by commit order), and a load finds it."""
    with start_store() as a, start_store() as b:
        ca, cb = a.client(), b.client()
        tenplex.save({"model": torch.nn.Linear(4, 3), "step": 10}, job="roll", step=10, store=a.url)
        template = ca.manifest("roll", 10)
        _commit_by_hand(ca, cb, template, 20, "s20", torch.nn.Linear(4, 3), on="b")
        kept = torch.nn.Linear(4, 3)
        _commit_by_hand(ca, cb, template, 15, "s15", kept, on="ab")
        for c in (ca, cb):
            c.retain("roll", 1, protect=(15, "s15"))
        assert ca.versions("roll") == [15] and cb.versions("roll") == [15]
        target = {"model": torch.nn.Linear(4, 3), "step": 0}
        info = tenplex.load(target, job="roll", store=a.url, sources=[b.url])
        assert info.step == 15 and torch.equal(target["model"].weight, kept.weight)
        cb.retain("roll", 1)  # a retain naming no save (no room) keeps the newest complete one too
        assert cb.versions("roll") == [15]


def test_a_replica_store_keeps_at_most_keep_copies():
    """D replicates to R; five saves with keep=1: R ends with one copy, the newest save's, committed."""
    with start_store() as d, start_store() as r:
        d.client().set_peers([d.url, r.url], 1)
        for step in range(1, 6):
            h = tenplex.save(
                {"w": torch.full((256,), float(step))}, job="cap", step=step, store=d.url, keep=1
            )
            assert h.replicated and h.replication == {d.url: "done"}, h.replication
        copies = r.client().version_info("cap")
        assert [(v["step"], v["committed"], v["replica_of"]) for v in copies] == [(5, True, d.url)]
        assert d.client().versions("cap") == [5]


def test_a_failed_push_is_reported_and_leaves_no_partial_copy():
    """R has room for one save's copy: the second push fails half-way. The save reports it (never
    `done`), R deletes the half copy, and keeps the older complete copy."""
    with start_store() as d, start_store(memory_limit="12MiB") as r:
        d.client().set_peers([d.url, r.url], 1)

        def state(v: float) -> dict:
            return {"a": torch.full((1 << 20,), v), "b": torch.full((1 << 20,), v)}  # 4 MiB each

        assert tenplex.save(state(1.0), job="fail", step=1, store=d.url, keep=1).replicated
        h = tenplex.save(state(2.0), job="fail", step=2, store=d.url, keep=1)
        assert not h.replicated and h.replication[d.url].startswith("failed"), h.replication
        copies = r.client().version_info("fail")
        assert [(v["step"], v["committed"]) for v in copies] == [(1, True)]
        assert d.client().versions("fail") == [2]  # the save itself is committed and loadable


def test_a_stale_writers_seal_is_refused():
    """A writer of an abandoned save seals its blob after a new save of the version wrote the same name:
    the seal is refused, and the new save commits its own bytes."""
    with start_store() as s:
        stale, c = s.client(), s.client()
        stale.create_version("seal", 3, save_id="old")
        stale.allocate_blob("seal", 3, "r0/w", "float32", (4,), save_id="old")[:] = 9
        c.create_version("seal", 3, save_id="new")  # replaces the abandoned attempt
        c.write_blob("seal", 3, "r0/w", np.arange(4, dtype=np.float32), save_id="new")
        with pytest.raises(ConflictError, match="belongs to save new"):
            stale.seal_blob("seal", 3, "r0/w")
        with pytest.raises(ConflictError):  # a seal naming no save is refused too
            c.request("POST", "/v1/jobs/seal/versions/3/blobs/r0%2Fw/seal", {"digests": None})
        with pytest.raises(ConflictError, match="was deleted"):  # the old save is never reopened
            stale.create_version("seal", 3, save_id="old")
        c.commit("seal", 3, {"save_id": "new"})
        out = np.empty(4, np.float32)
        c.read_box("seal", 3, "r0/w", Box.full((4,)), out, save_id="new")
        assert out.tolist() == [0, 1, 2, 3]


def test_a_push_to_a_peer_that_deleted_the_step_is_refused_and_reported():
    """R deleted its copy of save S of step 7 (a retain, an operator): a push of S there is refused at
    every step — open, PUT, commit — and D's commit reports the push `failed`, not `done`."""
    with start_store() as d, start_store() as r:
        cr = r.client(local=False)
        cr.create_version("gone", 7, save_id="S", replica_of=d.url)
        w = np.ones(16, np.float32)
        cr.put_raw("gone", 7, "r0/w", "float32", (16,), [memoryview(w).cast("B")],
                   _digests(w), replica_of=d.url, save_id="S")  # fmt: skip
        cr.delete_version("gone", 7)
        with pytest.raises(ConflictError, match="was deleted"):
            cr.put_raw("gone", 7, "r0/x", "float32", (16,), [memoryview(w).cast("B")],
                       _digests(w), replica_of=d.url, save_id="S")  # fmt: skip
        with pytest.raises(ConflictError, match="was deleted"):
            cr.create_version("gone", 7, save_id="S", replica_of=d.url)
        with pytest.raises(NotFoundError):
            cr.commit("gone", 7, {"save_id": "S"}, replica_of=d.url)

        d.client().set_peers([d.url, r.url], 1)
        cd = d.client()
        cd.create_version("gone", 7, save_id="S")
        cd.write_blob("gone", 7, "r0/w", w, save_id="S")
        info = cd.commit("gone", 7, {"save_id": "S"}, wait_replicas=True)
        assert info["replication"].startswith("failed") and "was deleted" in info["replication"], info
        with pytest.raises(NotFoundError):
            cr.version_info("gone")  # nothing recreated there


def test_a_relay_fetch_racing_a_drop_and_a_job_delete_leaves_nothing():
    """The remote is paused while a relay fetch waits on it; the relay is dropped and the job deleted
    here meanwhile; the fetch then completes: its piece serves that request only and is freed."""
    with start_store() as remote, start_store() as here:
        rc, hc = remote.client(local=False), here.client()
        rc.create_version("race", 1, save_id="R")
        rc.write_blob("race", 1, "w", np.full(1 << 18, 3.0, np.float32), save_id="R")
        rc.commit("race", 1, {"save_id": "R"})
        base = hc.stats()["memory_used"]
        for _ in range(3):  # bounded: each round pauses the remote once
            out = np.empty(1 << 18, np.float32)
            os.kill(remote.proc.pid, signal.SIGSTOP)
            try:
                fetch = threading.Thread(
                    target=hc.fetch_remote,
                    args=(remote.url, "race", 1, "w", None, out),
                    kwargs={"save_id": "R"},
                )
                fetch.start()
                time.sleep(0.5)  # the fetch is under way, waiting on the paused remote
                here.client().drop_relay("race", 1)
                with pytest.raises(NotFoundError):
                    here.client().delete_job("race")
            finally:
                os.kill(remote.proc.pid, signal.SIGCONT)
            fetch.join(60)
            assert not fetch.is_alive() and (out == 3).all()
            stats = hc.stats()
            assert stats["relay_blobs"] == 0 and stats["memory_used"] == base, stats


def test_a_relay_read_without_a_save_id_is_pinned_to_one_save():
    """A relay read naming no save reads the save the remote shows now, never a piece cached from the
    save it showed before."""
    with start_store() as remote, start_store() as here:
        rc, hc = remote.client(local=False), here.client()
        out = np.empty(16, np.float32)
        for save, value in (("A", 1.0), ("B", 2.0)):
            if 4 in rc.versions("pin"):
                rc.delete_version("pin", 4)
            rc.create_version("pin", 4, save_id=save)
            rc.write_blob("pin", 4, "w", np.full(16, value, np.float32), save_id=save)
            rc.commit("pin", 4, {"save_id": save})
            hc.fetch_remote(remote.url, "pin", 4, "w", None, out)
            assert (out == value).all(), save


def _digests(a: np.ndarray) -> list[int]:
    from tenplex.store.checksum import chunk_digests

    return chunk_digests(memoryview(a).cast("B"))


def test_a_save_of_a_committed_step_that_fails_midway_leaves_the_step_readable():
    """Step 5 is complete; a new save of step 5 opens, writes and dies before its commit: the old save
    stays the one shown and loaded (and survives retain); once a new save of the step commits, it replaces
    the old one, whose blobs go."""
    with start_store() as s:
        c = s.client()
        old = torch.nn.Linear(4, 3)
        tenplex.save({"model": old, "step": 5}, job="again", step=5, store=s.url)
        first = c.save_ids("again")[5]
        c.create_version("again", 5, save_id="torn")  # the new save's writer: opens, writes, dies
        c.write_blob("again", 5, "r0/model.weight", np.zeros((3, 4), np.float32), save_id="torn")
        assert c.save_ids("again") == {5: first}
        assert c.retain("again", 1) == [] and c.save_ids("again") == {5: first}
        target = {"model": torch.nn.Linear(4, 3), "step": 0}
        assert tenplex.load(target, job="again", store=s.url).step == 5
        assert torch.equal(target["model"].weight, old.weight)
        new = torch.nn.Linear(4, 3)
        tenplex.save({"model": new, "step": 5}, job="again", step=5, store=s.url)  # replaces the torn one
        assert c.save_ids("again")[5] not in (first, "torn")
        assert [v["step"] for v in c.version_info("again")] == [5]  # one save of the step is left
        assert c.stats()["blobs"] == 2
        tenplex.load(target, job="again", store=s.url)
        assert torch.equal(target["model"].weight, new.weight)


def test_a_resave_committed_on_one_store_only_leaves_the_steps_complete_save_loadable():
    """Step 1 is complete on A and B (save P); a save of step 1 again (X) commits on A and its committer
    dies before B: A keeps P readable beside X, so P is still complete and is what a load takes; the next
    save that completes (X saved again, say) supersedes P."""
    with start_store() as a, start_store() as b:
        ca, cb = a.client(), b.client()
        old = torch.nn.Linear(4, 3)
        tenplex.save({"model": old, "step": 1}, job="roll", step=1, store=a.url)
        template = ca.manifest("roll", 1)
        p = _commit_by_hand(ca, cb, template, 1, "P", old, on="ab")
        for c in (ca, cb):
            c.retain("roll", None, protect=(1, "P"))
        _commit_by_hand(ca, cb, p, 1, "X", torch.nn.Linear(4, 3), on="a")  # B never committed X
        assert ca.committed_saves("roll")[1] == ["X", "P"] and cb.committed_saves("roll")[1] == ["P"]
        target = {"model": torch.nn.Linear(4, 3), "step": 0}
        info = tenplex.load(target, job="roll", store=a.url, sources=[b.url])
        assert info.step == 1 and torch.equal(target["model"].weight, old.weight)
        assert ca.retain("roll", 1) == [1] and cb.retain("roll", 1) == []  # P is the newest complete save:
        assert ca.committed_saves("roll")[1] == ["P"]  # X, partial and superseded, alone went on A
        assert tenplex.load(target, job="roll", store=a.url, sources=[b.url]).step == 1


def test_a_failed_resave_deletes_its_own_open_version_only():
    """A save of a committed step that fails on some rank deletes its open version (`delete_version` with
    its save id), never the step's committed save; an abandoned open version retention drops leaves the
    committed save of the step readable and listed."""
    with start_store() as s:
        c = s.client()
        kept = torch.nn.Linear(4, 3)
        tenplex.save({"model": kept, "step": 5}, job="fail", step=5, store=s.url)
        first = c.save_ids("fail")[5]
        c.create_version("fail", 5, save_id="doomed")
        c.write_blob("fail", 5, "r0/model.weight", np.zeros((3, 4), np.float32), save_id="doomed")
        c.delete_version("fail", 5, "doomed")  # what every rank of a failed save does
        assert c.save_ids("fail") == {5: first}
        c.create_version("fail", 5, save_id="abandoned")  # a writer that dies; then step 6 completes
        tenplex.save({"model": torch.nn.Linear(4, 3), "step": 6}, job="fail", step=6, store=s.url, keep=3)
        assert c.save_ids("fail") == {5: first, 6: c.save_ids("fail")[6]}
        target = {"model": torch.nn.Linear(4, 3), "step": 0}
        assert tenplex.load(target, job="fail", step=5, store=s.url).step == 5
        assert torch.equal(target["model"].weight, kept.weight)
