"""Worker for tests/test_lost_stores.py: two dp ranks, each on its own store, save steps 10 and 20 of job
`lost` (every store then holds a full copy of both), and step 10 of job `gone`; or two tp ranks save
steps 10 and 20 of job `torn` (`TENPLEX_TEST_CASE=torn`)."""

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


def a_peer_dies() -> None:
    """Rank 1 leaves right after the group formed; rank 0's save then meets a broken group."""
    import os

    from tenplex.transformer import GroupError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1:
        write_result({"left": True})
        os._exit(0)
    try:
        tenplex.save(build(LAYOUTS["dp2"], rank, 1, False), job="broken", step=1)
        out = {"error": None}
    except GroupError as e:
        out = {"error": "GroupError", "message": str(e)}
    except BaseException as e:  # what a user would have to catch otherwise
        out = {"error": type(e).__name__, "message": str(e)}
    write_result(out)
    os._exit(0)  # the group is broken: no teardown that would wait on it


def torn() -> None:
    """Two tp ranks, each on its own store (its shards of every tensor its own): steps 10 and 20."""
    dist.init_process_group("gloo")
    for step in (10, 20):
        tenplex.save(build(LAYOUTS["tp2"], dist.get_rank(), step, False), job="torn", step=step)
    write_result({"rank": dist.get_rank()})
    dist.destroy_process_group()


if __name__ == "__main__":
    import os

    case = os.environ.get("TENPLEX_TEST_CASE")
    a_peer_dies() if case == "peer-dies" else torn() if case == "torn" else main()
