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
