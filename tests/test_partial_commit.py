"""A version committed on only some of its stores (a controller killed between commits) is never loaded."""

from __future__ import annotations

import torch

import tenplex
from tenplex.store import start_store


def test_a_partially_committed_version_is_skipped_for_the_previous_one():
    with start_store() as a, start_store() as b:
        model = torch.nn.Linear(4, 3)
        tenplex.save({"model": model, "step": 1}, job="partial", step=1, store=a.url)
        ca, cb = a.client(), b.client()
        manifest = ca.manifest("partial", 1)
        manifest = {**manifest, "step": 2, "stores": [a.url, b.url]}
        for blob in ca.blobs("partial", 1):
            data = torch.zeros(blob["shape"]).numpy()
            ca.read_box("partial", 1, blob["name"], _full(blob["shape"]), data)
            ca.write_blob("partial", 2, blob["name"], data + 1)
        cb.create_version("partial", 2)
        ca.commit("partial", 2, manifest)  # B never commits: the controller died here
        target = {"model": torch.nn.Linear(4, 3), "step": 0}
        info = tenplex.load(target, job="partial", store=a.url, sources=[b.url])
        assert info.step == 1 and target["step"] == 1
        assert torch.equal(target["model"].weight, model.weight)
        cb.commit("partial", 2, manifest)  # once every store has it, version 2 is the newest
        assert tenplex.load(target, job="partial", store=a.url, sources=[b.url]).step == 2


def _full(shape):
    from tenplex.ptc import Box

    return Box.full(tuple(shape))


def test_a_torn_step_is_saved_again_and_the_new_save_wins():
    """A writer died mid-way through step 2: committed on A only, and an unsealed blob left on B. A later
    save of step 2 (the job replaying it after the failure) must succeed on either store and be the one
    loaded; the torn commit must never be mixed in."""
    with start_store() as a, start_store() as b:
        job = "torn"
        old = torch.nn.Linear(4, 3)
        tenplex.save({"model": old, "step": 2}, job=job, step=2, store=a.url)
        ca, cb = a.client(), b.client()
        torn = {**ca.manifest(job, 2), "stores": [a.url, b.url], "save_id": "the-dead-writer"}
        first = ca.save_ids(job)[2]
        tenplex.save({"model": old, "step": 2}, job=job, step=2, store=a.url)  # a committed step is replaced
        assert ca.save_ids(job)[2] not in (None, first)
        ca.delete_version(job, 2)
        for blob in _blobs_of(old):
            ca.write_blob(job, 2, blob[0], blob[1])
        ca.commit(job, 2, torn)  # A committed the dead writer's version; B never did
        cb.create_version(job, 2)
        cb.allocate_blob(job, 2, "r7/left-over", "float32", (5,))  # never sealed: its writer died

        new = torch.nn.Linear(4, 3)
        tenplex.save({"model": new, "step": 2}, job=job, step=2, store=b.url)  # the leftover is dropped
        assert [x["name"] for x in cb.blobs(job, 2)] == [n for n, _ in _blobs_of(new)]
        target = {"model": torch.nn.Linear(4, 3), "step": 0}
        info = tenplex.load(target, job=job, store=a.url, sources=[b.url])
        assert info.step == 2 and torch.equal(target["model"].weight, new.weight)

        again = torch.nn.Linear(4, 3)  # and a save onto the store with the torn commit replaces it
        tenplex.save({"model": again, "step": 2}, job=job, step=2, store=a.url)
        target = {"model": torch.nn.Linear(4, 3), "step": 0}
        tenplex.load(target, job=job, store=a.url, sources=[])
        assert torch.equal(target["model"].weight, again.weight)


def _blobs_of(model):
    return [(f"r0/model.{k}", v.detach().numpy()) for k, v in sorted(model.state_dict().items())]
