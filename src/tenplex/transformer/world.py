"""The process group as the transformer sees it; without one, a world of one rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def size() -> int:
    return dist.get_world_size() if active() else 1


def all_gather(obj: Any) -> list[Any]:
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()
