"""What one rank holds of each tensor: the global shape, the box and a numpy view of the local bytes."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

from ..ptc import ITEM_SIZE, Box
from ..store.keys import NUMPY_DTYPE
from ..util.arena import Arena
from .errors import StateError

# every dtype a checkpoint may hold, by the PTC's names (ptc/dtypes.py); those this torch lacks are left out
DTYPES: dict[torch.dtype, str] = {
    getattr(torch, name): name for name in ITEM_SIZE if isinstance(getattr(torch, name, None), torch.dtype)
}
# numpy has no bfloat16, float8, float4 or complex32: their bytes travel as unsigned integers of their width,
# as the store expects (store/keys.py NUMPY_DTYPE)
VIEW_AS = {
    t: getattr(torch, NUMPY_DTYPE[name].name) for t, name in DTYPES.items() if NUMPY_DTYPE[name].name != name
}


@dataclass
class LocalShard:
    """This rank's piece of tensor `name`: `local` is the tensor the bytes live in (written in place)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    box: Box
    local: torch.Tensor

    def describe(self) -> tuple[tuple[int, ...], str, tuple[tuple[int, ...], tuple[int, ...]]]:
        return self.shape, self.dtype, (self.box.start, self.box.stop)

    @property
    def array_dtype(self) -> np.dtype:
        """The dtype its bytes have in the stores and in scratch arrays (bfloat16: uint16)."""
        return NUMPY_DTYPE[self.dtype]


def stored_dtype(name: str, dtype: torch.dtype) -> str:
    """The PTC's name of a tensor's dtype; the one error for a dtype the stores cannot hold."""
    if dtype not in DTYPES:
        raise StateError(f"tensor {name!r} has dtype {dtype}, which tenplex cannot store")
    return DTYPES[dtype]


PIECE = "_tenplex_piece"  # the attribute `piece` tags a tensor with: (global shape, start)


def piece(local: torch.Tensor, shape: tuple[int, ...], start: tuple[int, ...]) -> torch.Tensor:
    """`local` as the box of a larger tensor (global `shape`) that begins at `start`: for layouts no DTensor
    placement describes, such as a ZeRO flat partition's range of one flattened parameter. Returns `local`
    itself, tagged; save and load treat it as that box (load writes into it in place)."""
    setattr(local, PIECE, (tuple(shape), tuple(start)))
    return local


def local_shard(name: str, tensor: torch.Tensor) -> LocalShard:
    dtype = stored_dtype(name, tensor.dtype)
    if isinstance(tensor, DTensor):
        placements = tensor.placements
        if any(isinstance(p, Partial) for p in placements):
            raise StateError(f"tensor {name!r} is a Partial DTensor: reduce it before saving or loading")
        with torch.no_grad():  # the local tensor itself, not an autograd view of it (paid per tensor)
            local = tensor.to_local()
        shape = tuple(tensor.shape)
        if any(isinstance(p, _StridedShard) for p in placements):
            box = _strided_box(name, tensor)
        else:
            mesh = tensor.device_mesh
            start = _offset(shape, mesh, placements, tuple(mesh.get_coordinate() or ()))
            stop = tuple(min(a + s, g) for a, s, g in zip(start, local.shape, shape))
            box = Box(tuple(min(a, g) for a, g in zip(start, shape)), stop)
        if box.shape != tuple(local.shape):
            raise StateError(f"tensor {name!r}: local shape {list(local.shape)} does not match box {box}")
    elif hasattr(tensor, PIECE):
        local, (shape, start) = tensor, getattr(tensor, PIECE)
        stop = tuple(a + n for a, n in zip(start, local.shape))
        inside = all(a >= 0 and b <= g for a, b, g in zip(start, stop, shape))
        if not (len(start) == len(shape) == local.dim() and inside):
            raise StateError(f"tensor {name!r}: a piece at {list(start)} of shape {list(local.shape)} is not "
                             f"inside its global shape {list(shape)}")  # fmt: skip
        box = Box(start, stop)
    else:
        local, shape = tensor, tuple(tensor.shape)
        box = Box.full(shape)
    return LocalShard(name, shape, dtype, box, local)


@functools.lru_cache(maxsize=4096)
def _offset(
    shape: tuple[int, ...], mesh: Any, placements: tuple, coordinate: tuple[int, ...]
) -> tuple[int, ...]:
    """A shard's global offset, computed once per (shape, mesh, placements, this rank's coordinate): the
    tensors of a model share a few layouts, and torch's computation, paid per tensor by every save and load,
    is much of their `describe` phase (`python benchmarks/bench_reconfig.py`, results/bench_reconfig.json).
    The coordinate is part of the key because a process may hold another rank of an equal mesh later (a
    standby process serving a new phase)."""
    _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(int(o) for o in offset)


def _strided_box(name: str, tensor: DTensor) -> Box:
    """The box of a DTensor with `_StridedShard` placements, exactly: the global indices of this rank's
    elements along each dimension, found by applying the placements' own splitting (torch's, left to
    right) to index ranges. FSDP2 over tensor parallelism gives one contiguous range per dimension; any
    layout that interleaves a rank's elements (a strided shard not undone by a later shard) cannot be held
    as one box, so it is refused instead of being described wrongly."""
    mesh, shape = tensor.device_mesh, tuple(tensor.shape)
    coords = mesh.get_coordinate()
    if coords is None:
        raise StateError(f"tensor {name!r}: this rank is not in the DTensor's mesh")
    index = [torch.arange(n) for n in shape]
    for mesh_dim, p in enumerate(tensor.placements):
        if isinstance(p, _StridedShard):
            along = _StridedShard(0, split_factor=p.split_factor)
        elif isinstance(p, Shard):
            along = Shard(0)
        else:
            continue
        chunks, _ = along._split_tensor(index[p.dim], mesh.size(mesh_dim), with_padding=False)
        c = coords[mesh_dim]
        index[p.dim] = chunks[c] if c < len(chunks) else index[p.dim][:0]
    start, stop = [], []
    for d, ix in enumerate(index):
        first = int(ix[0]) if len(ix) else 0
        if len(ix) and not torch.equal(ix, torch.arange(first, first + len(ix))):
            raise StateError(
                f"tensor {name!r}: placements {list(tensor.placements)} give this rank elements "
                f"{ix[:8].tolist()}{'...' if len(ix) > 8 else ''} of dim {d}, which are not one contiguous "
                "range; tenplex holds one box per rank and tensor (redistribute it, e.g. to Shard placements)"
            )
        start.append(first)
        stop.append(first + len(ix))
    return Box(tuple(start), tuple(stop))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view sharing memory with a CPU tensor (bfloat16, float8... viewed as unsigned integers)."""
    t = t.detach()
    if t.dtype in VIEW_AS:
        t = t.view(VIEW_AS[t.dtype])
    return t.numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, through numpy when both are on the CPU: one thread at memory speed whatever the
    caller's intra-op thread setting. torch's copy_ splits a copy over its OpenMP threads, which crawl when
    the host's cores are taken (ranks x threads > cores); the load's `write` phase in
    `python benchmarks/bench_reconfig.py` (results/bench_reconfig.json) shows what it costs."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(as_numpy(dst), as_numpy(src), casting="no")
    else:
        dst.copy_(src)


def host_resident(t: torch.Tensor) -> bool:
    """Whether `t`'s own memory can be read or written as a host array: a contiguous CPU tensor."""
    return t.device.type == "cpu" and t.is_contiguous()


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, arena: Arena | None = None) -> torch.Tensor:
    """An uninitialized CPU tensor, taken from `arena` when one is given (huge pages, see util.arena)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if arena is None or nbytes == 0:
        return torch.empty(shape, dtype=dtype, device="cpu")
    return torch.from_numpy(arena.take(nbytes)).view(dtype).reshape(shape)


class Staged:
    """Host memory for a tensor's bytes: the tensor itself on CPU, a copy for accelerators, and always a
    copy, taken from the arena, with `scratch` (a load writes its targets only once every box arrived and
    verified)."""

    def __init__(self, t: torch.Tensor, fill: bool, scratch: Arena | None = None) -> None:
        self.tensor = t
        if host_resident(t) and scratch is None:
            self.host = t
        else:
            self.host = host_empty(t.shape, t.dtype, scratch)
            if fill:
                copy_into(self.host, t)
        self.array = as_numpy(self.host)

    def finish(self) -> None:
        if self.host is not self.tensor:
            copy_into(self.tensor, self.host)
