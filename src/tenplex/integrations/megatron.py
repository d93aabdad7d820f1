"""Megatron-core models for `tenplex.save` / `tenplex.load`, described by their own `sharded_state_dict()`.

Megatron names every tensor of a model in a layout-free way: a `ShardedTensor` carries a checkpoint key,
the global shape, this rank's offset in it, how many fragments each axis is cut into and a replica id.
Layers are stacked along prepended axes (`decoder.layers.*` has the global layer index first), so one key
appears once per layer on a rank: tenplex names each stacked slice on its own, `key[layer]`, the same name
under any pipeline split. The rest becomes tensors whose layout tenplex already reads: a DTensor sharded
over the tensor-parallel group for a fragmented axis, the local tensor itself for a whole one. Both share
Megatron's parameter storage, so a load writes the parameters in place. Replicas (the data-parallel
ranks, a tied embedding on the last stage) are the ranks that describe the same box; the planner picks
one of them per reader, so replica ids are not needed.

What this does not describe, refused with a `MegatronLayoutError` (a `TenplexError`) naming the key:
factories (`ShardedTensorFactory`, e.g. SwiGLU's split fc1), objects other than `None` (`ShardedObject`),
more than one cut axis, and an axis cut otherwise than `Shard(axis)` over the group given.
(megatron-core 0.16 itself refuses `flattened_range`, the old distributed-optimizer format.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..ptc import TenplexError


class MegatronLayoutError(TenplexError):
    """A Megatron sharded state tenplex cannot hold as one box per rank and tensor."""


def model_state(model: Any, group: Any = None) -> dict[str, torch.Tensor]:
    """The state of a Megatron-core module (or of a sharded state dict it made) for `tenplex.save` and
    `tenplex.load`: tensor name -> a DTensor over `group` (default: Megatron's tensor-parallel group) or a
    plain tensor, sharing the module's storage."""
    return as_tensors(sharded_tensors(model), group)


def sharded_tensors(model: Any) -> dict[str, ShardedTensor]:
    """The module's ShardedTensors by tenplex name (`slice_name`); `None` objects left out, anything
    tenplex cannot hold refused."""
    sharded = model.sharded_state_dict() if hasattr(model, "sharded_state_dict") else model
    out: dict[str, ShardedTensor] = {}
    for where, item in _items(sharded):
        if isinstance(item, ShardedObject):
            if item.data is not None:
                raise MegatronLayoutError(
                    f"{item.key} ({where}) is an object ({type(item.data).__name__}); tenplex holds tensors "
                    "and plain values"
                )
            continue
        if isinstance(item, ShardedTensorFactory):
            raise MegatronLayoutError(
                f"{item.key} ({where}) is a ShardedTensorFactory: its tensors are built at save time; "
                "build the model without it (e.g. no gated linear unit in a fused fc1)"
            )
        if not isinstance(item, ShardedTensor):
            raise MegatronLayoutError(f"{where} is a {type(item).__name__}, not a Megatron ShardedTensor")
        name = slice_name(item)
        if name in out:
            raise MegatronLayoutError(f"{name} is held twice by this rank ({where})")
        out[name] = item
    return out


def as_tensors(sharded: dict[str, ShardedTensor], group: Any = None) -> dict[str, torch.Tensor]:
    """`as_tensor` of each, named by the keys of `sharded`, over `group` (default: Megatron's TP group)."""
    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    meshes: dict[str, DeviceMesh] = {}
    out = {}
    for name, st in sharded.items():
        device = st.data.device.type
        mesh = meshes.get(device) or meshes.setdefault(device, DeviceMesh.from_group(group, device))
        out[name] = as_tensor(st, mesh)
    return out


def _items(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _items(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _items(v, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, tree


def slice_name(st: ShardedTensor) -> str:
    """`key`, or `key[i,...]` for a slice of prepended (stacked-layer) axes: global indices, so a layer
    has one name whatever stage holds it."""
    k = st.prepend_axis_num
    if k == 0:
        return st.key
    return f"{st.key}[{','.join(str(i) for i in st.global_offset[:k])}]"


def as_tensor(st: ShardedTensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's piece of `st` as a tensor tenplex reads the box of: the local data when the slice is
    whole, else a DTensor with `Shard(axis)` over `mesh`, checked to give Megatron's own offset."""
    name = slice_name(st)
    k = st.prepend_axis_num
    shape, offset, local = tuple(st.global_shape[k:]), tuple(st.global_offset[k:]), st.data
    if tuple(local.shape) != tuple(st.local_shape):
        raise MegatronLayoutError(f"{name}: data shape {list(local.shape)} is not {list(st.local_shape)}")
    cut = [a for a, f in enumerate(st.axis_fragmentations[k:]) if f > 1]
    if not cut:
        if tuple(local.shape) != shape:
            raise MegatronLayoutError(
                f"{name}: a whole slice of shape {list(local.shape)}, not {list(shape)}"
            )
        return local
    if len(cut) > 1:
        raise MegatronLayoutError(f"{name} is cut along axes {cut}; tenplex reads one tensor-parallel axis")
    placements = [Shard(cut[0])]
    want = compute_local_shape_and_global_offset(shape, mesh, placements)
    if (tuple(want[0]), tuple(want[1])) != (tuple(local.shape), offset):
        raise MegatronLayoutError(
            f"{name}: this rank holds {list(local.shape)} at offset {list(offset)}, but Shard({cut[0]}) over "
            f"the group of {mesh.size()} ranks gives {list(want[0])} at {list(want[1])}"
        )
    stride = torch.empty(shape, device="meta").stride()
    # detached: the parameter's storage, without an autograd edge (a no_grad view could not be sliced later)
    local = local.detach()
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
    )
