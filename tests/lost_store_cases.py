"""Worker for tests/test_lost_stores.py: two dp ranks, each on its own store, save steps 10 and 20 of job
`lost` (every store then holds a full copy of both), and step 10 of job `gone`."""

from __future__ import annotations

import torch.distributed as dist

import tenplex
from launch import write_result
from transformer_cases import LAYOUTS, build


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for step in (10, 20):
        tenplex.save(build(LAYOUTS["dp2"], rank, step, False), job="lost", step=step)
    tenplex.save(build(LAYOUTS["dp2"], rank, 10, False), job="gone", step=10)
    write_result({"rank": rank})
    dist.destroy_process_group()  # before the interpreter's teardown: gloo aborts there otherwise


if __name__ == "__main__":
    main()
