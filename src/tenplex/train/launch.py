"""Spawn a local process group: `spawn(fn, world, *args)` runs fn(*args) in `world` gloo/nccl ranks.

The backend follows the device asked for (`device`, as `TrainConfig.device`), not whether CUDA happens to
exist: CPU work on a GPU machine stays on gloo (NCCL would put every rank on the one GPU and refuse).

Why not `torch.multiprocessing.spawn`: we need a free port chosen here, the results of every rank back in
the parent, and the first failing rank's error (not a hang of the others) reported as the failure.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from ..ptc import TenplexError
from ..util import free_port
from ..util.ranks import rank_env


class LaunchError(TenplexError, RuntimeError):
    """A rank failed; the message carries its traceback's last line."""


_CHANNEL: Any = None  # the parent's queue, inside a spawned rank


def report(value: Any) -> None:
    """From inside a spawned rank: hand `value` to the parent's `on_progress` callback (no-op elsewhere)."""
    if _CHANNEL is not None:
        _CHANNEL.put((-1, "progress", value))


def _entry(
    rank: int, world: int, port: int, device: str, fn: Callable[..., Any], args: tuple, results: Any
) -> None:
    import sys

    import torch
    import torch.distributed as dist

    from ..transformer.world import init_distributed

    global _CHANNEL
    _CHANNEL = results

    os.environ.update(rank_env(rank, world, port), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        init_distributed(device)
        out = fn(*args)
        pickle.dumps(out)  # fail here, reported, rather than silently in the queue's feeder thread
        results.put((rank, "ok", out))
    except BaseException as e:  # report, then exit non-zero so the parent stops the others
        if not isinstance(e, TenplexError):
            traceback.print_exc(file=sys.stderr)
        results.put((rank, "error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    on_progress: Callable[[Any], None] | None = None,
    device: str = "cpu",
) -> list[Any]:
    """Run `fn(*args)` in `world` fresh ranks; return every rank's result, ordered by rank.

    `device`: cpu (gloo), cuda (NCCL, a GPU per local rank) or auto (cuda where there is one).
    `fn` must be importable by name (a module-level function); what it passes to `report()` reaches
    `on_progress` in the parent while the ranks run.
    """
    ctx = context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, device, fn, args, results), daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    lost_polls = 0
    try:
        while len(out) < world:
            try:
                rank, kind, value = results.get(timeout=1.0)
            except queue.Empty:
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in out]
                if gone:  # results are flushed before exit: allow a few empty polls for one in flight
                    lost_polls += 1
                    if lost_polls > 3:
                        code = procs[gone[0]].exitcode
                        raise LaunchError(
                            f"rank {gone[0]} exited with code {code} without a result"
                        ) from None
                continue
            if kind == "progress":
                if on_progress is not None:
                    on_progress(value)
                continue
            if kind == "error":
                raise LaunchError(f"rank {rank} failed: {value}")
            out[rank] = value
    finally:
        for p in procs:
            if len(out) < world and p.is_alive():
                p.terminate()
            p.join()
    return [out[r] for r in range(world)]


def context() -> Any:
    return mp.get_context("spawn")


def _train_rank(cfg: Any) -> list[Any]:
    from .trainer import run_worker

    return run_worker(cfg, on_step=report)


def train_locally(cfg: Any, on_step: Callable[[Any], None] | None = None) -> list[Any]:
    """Train `cfg` (a `TrainConfig`) in dp*tp*pp local ranks; rank 0's per-step metrics, in order."""
    return spawn(_train_rank, cfg.layout.world, cfg, on_progress=on_step, device=cfg.device)[0]
