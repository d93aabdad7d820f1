"""Megatron-core models for `tenplex.save` / `tenplex.load`, named exactly as a `torch_dist` checkpoint.

Megatron names every tensor of a model in a layout-free way: a `ShardedTensor` carries a checkpoint key,
the global shape, this rank's offset in it and a replica id. Layers are stacked along prepended axes
(`decoder.layers.*` has the global layer index first), so one key appears once per layer on a rank. tenplex
names each key once, with the global shape Megatron writes to its checkpoints (stacked axes included), and
holds this rank's layers of it as one box (`tenplex.transformer.shards.piece`): the parameter itself when
the rank holds one layer, a stacked copy written back into the layers after a load when it holds several.
Replicas (the data-parallel ranks, a tied embedding on the last stage) are the ranks that describe the same
box; the planner picks one of them per reader. Because the names and shapes are the checkpoint's own, a
`torch_dist` folder becomes a snapshot, and a snapshot a `torch_dist` folder, without building the model
(`tenplex.integrations.megatron_checkpoint`). `ShardedObject`s whose data is `None` (the local layers'
`_extra_state`) are values `<key>/shard_<offset>_<shape>`, as the checkpoint names them.

What this does not describe, refused with a `MegatronLayoutError` (a `TenplexError`) naming the key:
factories (`ShardedTensorFactory`, e.g. SwiGLU's split fc1), objects other than `None`, and layers of one
key on one rank that are not one contiguous box (interleaved virtual pipeline stages).
(megatron-core 0.16 itself refuses `flattened_range`, the old distributed-optimizer format.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

from ..ptc import TenplexError
from ..transformer.shards import piece


class MegatronLayoutError(TenplexError):
    """A Megatron sharded state tenplex cannot hold as one box per rank and tensor."""


class ModelPieces:
    """A rank's Megatron tensors as tenplex tensors (`state_dict()`), by checkpoint key; handed back after
    a load (`load_state_dict`), it writes the stacked copies into the layers they came from."""

    def __init__(self, sharded: list[ShardedTensor], objects: list[str]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.copies: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for key, group in itertools.groupby(sorted(sharded, key=_order), key=lambda st: st.key):
            self.tensors[key] = self._piece(key, list(group))
        self.objects = dict.fromkeys(objects)

    def _piece(self, key: str, group: list[ShardedTensor]) -> torch.Tensor:
        group = _distinct(key, group)
        first, k = group[0], group[0].prepend_axis_num
        views = [st.data.detach().view((1,) * k + tuple(st.local_shape)) for st in group]
        if len(group) == 1:
            return piece(views[0], first.global_shape, first.global_offset)
        for a, b in itertools.pairwise(group):
            stacked = k == 1 and b.global_offset[0] == a.global_offset[0] + 1
            if not stacked or a.global_offset[1:] != b.global_offset[1:] or a.local_shape != b.local_shape:
                raise MegatronLayoutError(
                    f"{key}: this rank holds pieces at {list(a.global_offset)} and {list(b.global_offset)}, "
                    "not one contiguous range of layers (interleaved virtual pipeline stages?)"
                )
        stack = torch.cat(views)
        self.copies.append((stack, views))
        return piece(stack, first.global_shape, first.global_offset)

    def state_dict(self) -> dict[str, Any]:
        return {**self.tensors, **self.objects}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for stack, views in self.copies:
                for i, view in enumerate(views):
                    view.copy_(stack[i : i + 1])


def _order(st: ShardedTensor) -> tuple:
    return st.key, tuple(st.global_offset)


def _distinct(key: str, group: list[ShardedTensor]) -> list[ShardedTensor]:
    """One entry per box: a tied weight described twice on one rank is one piece (the same storage)."""
    out: list[ShardedTensor] = []
    for st in group:
        if out and tuple(out[-1].global_offset) == tuple(st.global_offset):
            if out[-1].data.data_ptr() != st.data.data_ptr() or out[-1].local_shape != st.local_shape:
                raise MegatronLayoutError(f"{key} at {list(st.global_offset)} is held twice by this rank")
            continue
        if tuple(st.data.shape) != tuple(st.local_shape):
            raise MegatronLayoutError(
                f"{key}: data shape {list(st.data.shape)} is not {list(st.local_shape)}"
            )
        out.append(st)
    return out


def model_state(model: Any) -> ModelPieces:
    """The state of a Megatron-core module (or of a sharded state dict it made) for `tenplex.save` and
    `tenplex.load`: a stateful object whose tensors share the module's storage or are written back into it."""
    sharded, objects = sharded_tensors(model)
    return ModelPieces(sharded, objects)


def sharded_tensors(model: Any) -> tuple[list[ShardedTensor], list[str]]:
    """The module's ShardedTensors, and the checkpoint names of its `None` objects; anything tenplex
    cannot hold refused."""
    sharded = model.sharded_state_dict() if hasattr(model, "sharded_state_dict") else model
    tensors: list[ShardedTensor] = []
    objects: list[str] = []
    for where, item in _items(sharded):
        if isinstance(item, ShardedObject):
            if item.data is not None:
                raise MegatronLayoutError(
                    f"{item.key} ({where}) is an object ({type(item.data).__name__}); tenplex holds tensors "
                    "and plain values"
                )
            objects.append(item.unique_key)
        elif isinstance(item, ShardedTensorFactory):
            raise MegatronLayoutError(
                f"{item.key} ({where}) is a ShardedTensorFactory: its tensors are built at save time; "
                "build the model without it (e.g. no gated linear unit in a fused fc1)"
            )
        elif isinstance(item, ShardedTensor):
            tensors.append(item)
        else:
            raise MegatronLayoutError(f"{where} is a {type(item).__name__}, not a Megatron ShardedTensor")
    return tensors, objects


def _items(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _items(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _items(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, tree
