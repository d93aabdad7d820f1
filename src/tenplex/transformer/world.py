"""The process group as the transformer sees it; without one, a world of one rank.

Every call takes the group the job's ranks form (None: the default group), like DCP's `process_group`.
"""

from __future__ import annotations

import atexit
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

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


def all_gather(obj: Any, group: Group = None) -> list[Any]:
    """Every rank's `obj`, in rank order: gathered to rank 0 and broadcast from there, in fixed slots;
    when an object does not fit its slot, once more with slots of the longest. Why not
    `all_gather_object`: it runs two of gloo's ring all-gathers (lengths, then bytes), each a step per rank
    and each step waiting for a process that may be off its core, where this is one gather and one
    broadcast; a save and a load call this five times between them (their `gather` and `barrier` phases
    in `python benchmarks/bench_reconfig.py`, results/bench_reconfig.json)."""
    if not active():
        return [obj]
    n = size(group)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    found, lengths = _exchange(data, max(64, min(SLOT, ROUND // n)), n, group)
    if None in found:
        found, _ = _exchange(data, max(lengths) + 8, n, group)
    return [pickle.loads(b) for b in found]


def _exchange(data: bytes, slot: int, n: int, group: Group) -> tuple[list[bytes | None], list[int]]:
    """One gather to rank 0 and one broadcast of every rank's slot (its length, then its bytes if they
    fit): the bytes of each rank (None where they did not fit) and every rank's length."""
    mine = torch.zeros(slot, dtype=torch.uint8)
    mine[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    if len(data) <= slot - 8:
        mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = torch.empty((n, slot), dtype=torch.uint8)
    with collective("an all-gather"):
        dist.gather(mine, list(every) if rank(group) == 0 else None, group=group, group_dst=0)
        dist.broadcast(every, group=group, group_src=0)
    raw = every.numpy()
    lengths = [int.from_bytes(raw[i, :8].tobytes(), "little") for i in range(n)]
    return [raw[i, 8 : 8 + k].tobytes() if k <= slot - 8 else None for i, k in enumerate(lengths)], lengths


def broadcast(obj: Any, group: Group = None) -> Any:
    """rank 0 of `group` sends `obj` to the others."""
    if not active():
        return obj
    box = [obj]
    with collective("a broadcast"):
        dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


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
    outcome: tuple[bool, Any] = (True, None)
    if rank(group) == 0:
        try:
            outcome = (True, fn())
        except Exception as e:  # handed to every rank, raised there
            outcome = (False, e)
    ok, value = broadcast(outcome, group)
    if not ok:
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
