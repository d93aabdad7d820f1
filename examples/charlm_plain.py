"""`examples/elastic_charlm.py` before it was made elastic: the same model, optimizer and sample order,
trained by plain PyTorch with no `ElasticJob`, no snapshots and no resume. tests/test_user_script.py
trains both and compares their losses step by step, so the documented pattern is held to the user's
original script, not to itself. tenplex only supplies the text (`build_corpus`).

    python examples/charlm_plain.py --steps 12 --losses runs/plain.json          # one process
    torchrun --nproc-per-node 2 examples/charlm_plain.py --steps 12 --losses ...  # FSDP2 over 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tenplex.data import TokenWindows, build_corpus

CONTEXT = 16


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--losses", required=True, help="JSON file: {step: mean loss over the global batch}")
    args = p.parse_args()

    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    windows = TokenWindows(build_corpus().tokens("train"), CONTEXT)
    order = np.random.default_rng([0, 0]).permutation(len(windows))  # seed 0, epoch 0

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(256, 32), nn.Flatten(), nn.Linear(32 * CONTEXT, 256), nn.GELU(), nn.Linear(256, 256)
    )
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses = {}
    for step in range(1, args.steps + 1):
        batch_ids = order[(step - 1) * args.global_batch : step * args.global_batch]
        ids = np.array_split(batch_ids, world)[rank]  # contiguous parts, the first ones one larger
        batch = torch.from_numpy(windows.get(ids))
        loss = nn.functional.cross_entropy(model(batch[:, :CONTEXT]), batch[:, CONTEXT])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / world
    if rank == 0:
        with open(args.losses, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
