"""The process group as the transformer sees it; without one, a world of one rank.

Every call takes the group the job's ranks form (None: the default group), like DCP's `process_group`.
"""

from __future__ import annotations

import atexit
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..ptc import TenplexError
from ..util.net import wait_listening
from .errors import GroupError

Group = Any  # a torch.distributed ProcessGroup or None
T = TypeVar("T")


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Group = None) -> int:
    return dist.get_rank(group) if active() else 0


def size(group: Group = None) -> int:
    return dist.get_world_size(group) if active() else 1


SLOT = 64 << 10  # bytes each rank's object takes in the first round, its 8-byte length included
ROUND = 4 << 20  # at most this many bytes gathered in a first round (many ranks: smaller slots)
GATHER_SLOT = 64 << 10  # a gather's first round: a few hundred tensors' descriptions, a job's values
REPLY_SLOT = 4 << 10  # the first round of a broadcast: an outcome, an id, a decision


def all_gather(obj: Any, group: Group = None, slot: int = SLOT) -> list[Any]:
    """Every rank's `obj`, in rank order: gathered to rank 0 and broadcast from there, in fixed slots
    (`slot` bytes each at most, fewer with many ranks); when an object does not fit its slot, once more
    with slots of the longest. Why not `all_gather_object`: it runs two of gloo's ring all-gathers
    (lengths, then bytes), each a step per rank and each step waiting for a process that may be off its
    core, where this is one gather and one broadcast. Every rank's slot travels to every rank: small
    objects take a small `slot`."""
    if not active():
        return [obj]
    n = size(group)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    found, lengths = _exchange(data, max(64, min(slot, ROUND // n)), n, group)
    if None in found:
        found, _ = _exchange(data, max(lengths) + 8, n, group)
    return [pickle.loads(b) for b in found]


def _framed(data: bytes, slot: int) -> torch.Tensor:
    """`slot` bytes: the length of `data`, then `data` if it fits."""
    mine = torch.zeros(slot, dtype=torch.uint8)
    mine[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if len(data) <= slot - 8:
        mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return mine


def _unframed(raw: Any, slot: int) -> tuple[bytes | None, int]:
    """What `_framed` made (None where it did not fit) and the length it named."""
    k = int.from_bytes(raw[:8].tobytes(), "little")
    return (raw[8 : 8 + k].tobytes() if k <= slot - 8 else None), k


def _exchange(data: bytes, slot: int, n: int, group: Group) -> tuple[list[bytes | None], list[int]]:
    """One gather to rank 0 and one broadcast of every rank's slot (its length, then its bytes if they
    fit): the bytes of each rank (None where they did not fit) and every rank's length."""
    every = torch.empty((n, slot), dtype=torch.uint8)
    with collective("an all-gather"):
        dist.gather(_framed(data, slot), list(every) if rank(group) == 0 else None, group=group, group_dst=0)
        dist.broadcast(every, group=group, group_src=0)
    found = [_unframed(row, slot) for row in every.numpy()]
    return [b for b, _ in found], [k for _, k in found]


def broadcast(obj: Any, group: Group = None, slot: int = REPLY_SLOT) -> Any:
    """rank 0 of `group` sends `obj` to the others: one broadcast of `slot` bytes, and one of the rest
    when it is longer (`broadcast_object_list` always takes two: the length, then the bytes)."""
    if not active():
        return obj
    me = rank(group)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if me == 0 else b""
    with collective("a broadcast"):
        first = _framed(data, slot) if me == 0 else torch.empty(slot, dtype=torch.uint8)
        dist.broadcast(first, group=group, group_src=0)
        whole, k = _unframed(first.numpy(), slot)
        if whole is None:
            rest = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if me == 0
                else torch.empty(k, dtype=torch.uint8)
            )
            dist.broadcast(rest, group=group, group_src=0)
            whole = rest.numpy().tobytes()
    return obj if me == 0 else pickle.loads(whole)


def gather_then(obj: Any, fn: Callable[[list[Any]], T], group: Group = None, slot: int = GATHER_SLOT) -> T:
    """Every rank's `obj` to rank 0, which runs `fn` on them (in rank order); every rank returns its
    result or raises its exception. One gather and one broadcast where an all-gather and then `decide`
    take four collectives: what is gathered goes to rank 0 only, what it decided comes back. A rank's
    object longer than `slot` costs one more gather."""
    if not active():
        return fn([obj])
    n, me = size(group), rank(group)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    while True:
        every = torch.empty((n, slot), dtype=torch.uint8) if me == 0 else None
        with collective("a gather"):
            dist.gather(_framed(data, slot), None if every is None else list(every), group=group, group_dst=0)
        reply: tuple[str, Any] = ("", None)
        if every is not None:
            found = [_unframed(row, slot) for row in every.numpy()]
            if any(b is None for b, _ in found):
                reply = ("again", max(k for _, k in found) + 8)
            else:
                reply = _outcome(partial(fn, [pickle.loads(b) for b, _ in found]))  # type: ignore[arg-type]
        kind, value = broadcast(reply, group)
        if kind == "again":
            slot = value
            continue
        if kind == "raised":
            raise value
        return value


Dealt = tuple[Any, list[Any]]  # what every rank gets, and one part per rank


def _dealt(common_and_parts: Dealt) -> tuple[Any, list[bytes]]:
    common, parts = common_and_parts
    return common, [pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL) for part in parts]


def _own(reply: tuple[Any, list[bytes]], group: Group) -> tuple[Any, Any]:
    common, parts = reply
    return common, pickle.loads(parts[rank(group)])


def gather_then_deal(obj: Any, fn: Callable[[list[Any]], Dealt], group: Group = None) -> tuple[Any, Any]:
    """`gather_then` where rank 0's `fn` returns (common, one part per rank): each rank returns the common
    answer and its own part, and unpickles no other rank's (rank 0 plans a load for all; each rank reads
    only its reads)."""
    return _own(gather_then(obj, lambda objs: _dealt(fn(objs)), group), group)


def deal(fn: Callable[[], Dealt], group: Group = None) -> tuple[Any, Any]:
    """`decide` for a `fn` that returns (common, one part per rank), as `gather_then_deal`."""
    return _own(decide(lambda: _dealt(fn()), group), group)


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except Exception as e:  # handed to every rank, raised there
        return ("raised", _travels(e))


def _travels(e: Exception) -> Exception:
    """`e`, or where it cannot be rebuilt from its pickle (an `__init__` that takes other arguments than
    its message and names no `__reduce__`), a TenplexError with its type and message: the other ranks
    would fail unpickling it deep inside a collective instead."""
    try:
        pickle.loads(pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL))
        return e
    except Exception:
        return TenplexError(f"{type(e).__name__}: {e}")


@contextmanager
def collective(what: str) -> Iterator[None]:
    """A collective whose failure is a `GroupError` naming it (gloo raises RuntimeError subclasses from
    deep inside when a peer is gone or the group timed out)."""
    try:
        yield
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise GroupError(f"the process group broke during {what}: {first}") from e


def decide(fn: Callable[[], T], group: Group = None) -> T:
    """Rank 0 of `group` runs `fn` and every rank returns its result or raises its exception, so that
    all ranks act on one answer (a store that answers one rank and not another cannot split them)."""
    if not active():
        return fn()
    kind, value = broadcast(_outcome(fn) if rank(group) == 0 else None, group)
    if kind == "raised":
        raise value
    return value


def barrier(group: Group = None) -> None:
    if active():
        with collective("a barrier"):
            dist.barrier(group=group)


def background_group(group: Group = None) -> Group:
    """A gloo group over the same ranks, for commits that finish in a background thread."""
    if not active():
        return None
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks=ranks, backend="gloo")
    # only the group's members call this: they must not wait for the others
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


_told_cpu: list[bool] = []  # the notice that `auto` stays on the CPU, given once per process


def use_cuda(device: str) -> bool:
    """Whether ranks asking for `device` (auto, cpu, cuda) run on GPUs. `auto` means a GPU for each local
    rank (LOCAL_WORLD_SIZE): with fewer, NCCL would put two ranks on one GPU and refuse, so the ranks stay
    on the CPU, and local rank 0 says so once."""
    import os
    import sys

    import torch

    if device != "auto":
        return device == "cuda"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if 0 < gpus < local and os.environ.get("LOCAL_RANK", "0") == "0" and not _told_cpu:
        _told_cpu.append(True)
        print(f"tenplex: {local} local ranks, {gpus} GPU(s): on the CPU (--device cuda needs a GPU per rank)",
              file=sys.stderr)  # fmt: skip
    return gpus >= local


def init_distributed(device: str = "auto") -> None:
    """The default group from the torchrun-style environment (RANK, WORLD_SIZE, MASTER_*), if not made yet:
    NCCL on this rank's GPU (LOCAL_RANK) when CUDA is there and wanted, else gloo. For any training script
    (`ElasticJob`) and the reference workload alike."""
    import os
    from datetime import timedelta

    import torch

    if active():
        return
    cuda = use_cuda(device)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    master, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's store listens already
    if master and port.isdigit() and os.environ.get("RANK", "0") != "0" and not agent_store:
        wait_listening(master, int(port), timeout=60.0)  # else init's own retries take over
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    atexit.unregister(_destroy_at_exit)  # once, however many groups a long-lived process makes
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """The group made here goes before the interpreter does: a gloo group left to the interpreter's
    teardown can abort the process ("terminate called without an active exception") after a clean end,
    when its C++ threads release Python objects too late (seen once in CI, a script that ended without
    destroying it)."""
    if active():
        dist.destroy_process_group()
