"""What a rank process imports and warms up before it is needed: once in a pool's zygote (`standby.py`) or
an agent's worker (`worker.py`), never while the job waits for it."""

from __future__ import annotations

from ..util import env

_preloaded = False  # a fork of a zygote that preloaded has it all: it inherits the flag with the rest


def preload() -> None:
    """What a rank would otherwise import while the job waits, and DTensor's one-time costs of a rank's
    first tensor-parallel build and step (`train.warmup`; `benchmarks/bench_warmup.py` measures both)."""
    global _preloaded
    if _preloaded:
        return
    import torch
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import torch.distributed.pipelining
    import torch.distributed.tensor.parallel  # noqa: F401

    import tenplex.runtime.job
    import tenplex.runtime.reference_rank
    from tenplex.train.warmup import warm_up

    if env.flag(env.CHOOSES):  # an agent's workers choose the layout of each round's world themselves
        import tenplex.runtime.chooser  # noqa: F401 - (scipy: seconds on few cores); `tenplex run` tells its
        # ranks their layout, so they never import it

    warm_up()
    _preloaded = True
