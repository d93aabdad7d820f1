"""Worker for tests/test_store_integrity.py: a step saved twice while one store replicates, then that store
dies and the step is loaded from the other store and the replica.

Rank 0 writes to store E, rank 1 to store D; D copies its committed versions to R (ring D -> R).
"""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist

import tenplex
from launch import write_result
from tenplex.store import StoreClient
from transformer_cases import LAYOUTS, build, check


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    alone = dist.new_group([0])
    d, r = os.environ["TENPLEX_TEST_D"], os.environ["TENPLEX_TEST_R"]
    if rank == 0:
        StoreClient(d).set_peers([d, r], 1)
    dist.barrier()
    lay = LAYOUTS["tp2"]
    tenplex.save(build(lay, rank, 1, False), job="twice", step=5)  # save A of step 5
    tenplex.save(build(lay, rank, 2, False), job="twice", step=5)  # save B replaces it (a replayed step)
    out: dict = {}
    if rank == 0:
        out["replica_save"] = StoreClient(r).save_ids("twice").get(5)
        out["primary_save"] = StoreClient(os.environ["TENPLEX_STORE"]).save_ids("twice").get(5)
        os.kill(int(os.environ["TENPLEX_TEST_KILL_PID"]), signal.SIGKILL)  # store D dies
        time.sleep(0.2)
        target = build(LAYOUTS["1"], 0, 2, True)
        info = tenplex.load(target, job="twice", process_group=alone, sources=[d, r])
        out.update(bad=check(target, 2), lost=info.lost_stores, replaced=info.replaced, step=info.step)
    dist.barrier()
    write_result(out)
    dist.destroy_process_group()  # before the interpreter's teardown: gloo aborts there otherwise


if __name__ == "__main__":
    main()
