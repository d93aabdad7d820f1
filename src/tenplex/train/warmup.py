"""Paying a process's one-time DTensor costs before it forks the ranks that would each pay them.

The first tensor-parallel layout a process builds and trains runs PyTorch's lazy one-time work: DTensor's
operator strategies registered on first use, fake-tensor shape propagation set up, dynamo's wrappers,
`get_state_dict`'s first walk. `benchmarks/bench_warmup.py` measures what the warm-up saves (fresh
processes that imported what the zygote imports, tiny GPT with tp=2 on a new mesh of a fake world of 2:
the build with its job state and the first step, with and without it). What stays is per mesh (DTensor's
caches are keyed on it, and `parallel.forget_meshes` empties them).

The warm-up runs on the "fake" backend (no collective moves data, no thread is started) with one intra-op
thread, the RNG state restored afterwards, and the world destroyed: a fork afterwards copies no lock held
by another thread and no group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.sampler import ElasticSampler
from ..ptc import PRESETS
from ..ptc.layout import Layout
from .optim import build_optimizer, build_scheduler
from .parallel import build_mesh, build_model, forget_meshes
from .state import job_state, load_job_state


def warm_up(model: str = "tiny", tp: int = 2) -> None:
    """Build, snapshot, restore and train one step of a `tp`-way GPT as rank 0 of a fake world, then forget
    it. A no-op in a process that already has a default process group (it would be replaced)."""
    if dist.is_initialized():
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
            try:
                cfg, layout = PRESETS[model], Layout(1, tp, 1)
                gpt = build_model(cfg, layout, build_mesh(layout, "cpu"), seed=0, device=torch.device("cpu"))
                optimizer = build_optimizer(gpt, lr=1e-3)
                scheduler = build_scheduler(optimizer, warmup=1, total=2)
                sampler = ElasticSampler(cfg.seq * 4, 2)
                x = torch.zeros(2, cfg.seq, dtype=torch.long)
                for _ in range(2):  # the second step runs the optimizer with its moments in place
                    optimizer.zero_grad(set_to_none=True)
                    F.cross_entropy(gpt(x).reshape(-1, cfg.vocab).float(), x.reshape(-1)).backward()
                    optimizer.step()
                    scheduler.step()
                state = job_state(gpt, optimizer, scheduler, sampler, 2)
                load_job_state(gpt, optimizer, scheduler, sampler, state)
            finally:
                dist.destroy_process_group()
                forget_meshes()
    finally:
        torch.set_num_threads(threads)
