"""`piece`: the transformer's hook for layouts no DTensor placement describes (ZeRO's ranges of flattened
parameters, tenplex.integrations.deepspeed). Needs no DeepSpeed."""

from __future__ import annotations

import pytest
import torch

from tenplex.ptc import Box
from tenplex.transformer import StateError
from tenplex.transformer.shards import local_shard, piece


def test_a_piece_is_its_box_of_the_global_tensor_and_shares_its_memory():
    flat = torch.arange(10, dtype=torch.float32)
    view = flat.narrow(0, 3, 4)
    shard = local_shard("master.w", piece(view, (7,), (2,)))
    assert (shard.shape, shard.box, shard.dtype) == ((7,), Box((2,), (6,)), "float32")
    shard.local.fill_(-1)  # a load writes there: into the flat partition itself
    assert flat[3:7].tolist() == [-1.0] * 4
    assert local_shard("empty", piece(flat.narrow(0, 0, 0), (7,), (7,))).box.empty


@pytest.mark.parametrize(("shape", "start"), [((7,), (5,)), ((7,), (-1,)), ((2, 7), (0,))])
def test_a_piece_outside_its_global_shape_is_refused(shape, start):
    with pytest.raises(StateError, match="is not inside its global shape"):
        local_shard("master.w", piece(torch.zeros(4), shape, start))
