"""Worker for tests/test_failures.py: snapshots on three emulated hosts, then host B dies (SIGKILL).

Host A: ranks 0-1, host B: ranks 2-3; store C holds B's replicas (store replication, ring B -> C).
"""

from __future__ import annotations

import os
import signal
import time
import traceback

import torch.distributed as dist

import tenplex
from launch import write_result
from tenplex.store import StoreClient
from tenplex.transformer import UnrecoverableError
from transformer_cases import LAYOUTS, build, check


def attempt(fn) -> object:
    try:
        return fn()
    except Exception as e:  # reported to the test
        return {"error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()[-2000:]}


def one_rank_fails(rank: int, pair) -> dict:
    """A byte of a blob only rank 1 reads is flipped: rank 0's reads succeed, yet both ranks raise with
    their targets untouched (none waits for the other), and with `path=` both load the DCP snapshot."""
    lay, job = LAYOUTS["tp2"], "flipped"
    tenplex.save(build(lay, rank, 5, False), job=job, step=1, process_group=pair)
    path = os.environ["TENPLEX_TEST_DCP"] + "-flipped"
    if rank == 0:
        tenplex.persist(job, 1, path)
        c = StoreClient(os.environ["TENPLEX_STORE"])
        info = c.request("POST", f"/v1/jobs/{job}/versions/1/locate", {"names": ["r1/model.lin.weight"]})
        with open(info["blobs"][0]["path"], "r+b") as f:
            f.seek(info["blobs"][0]["offset"])  # the blob's place in its file (a pack holds many blobs)
            byte = f.read(1)
            f.seek(info["blobs"][0]["offset"])
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier(pair)
    target = build(lay, rank, 5, True)
    try:
        tenplex.load(target, job=job, process_group=pair)
        raised = ""
    except tenplex.TenplexError as e:
        raised = str(e)
    untouched = check(target, 5)  # every tensor still zero: all of them differ from the saved ones
    info = tenplex.load(target, job=job, path=path, process_group=pair)
    return {"raised": raised, "untouched": untouched, "source": info.source, "bad": check(target, 5)}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.group.WORLD
    pair = dist.new_group([0, 1])
    out: dict = {}
    if rank < 2:
        out["one_rank_fails"] = attempt(lambda: one_rank_fails(rank, pair))
    dist.barrier()
    # dp replicas on both hosts; pipeline stage 1 only on host B (whose store replicates to C)
    tenplex.save(build(LAYOUTS["dp2tp2"], rank, 1, False), job="replicas", step=1, process_group=world)
    if rank == 0:  # from now on B's committed versions are copied to C
        b, c = os.environ["TENPLEX_TEST_B"], os.environ["TENPLEX_TEST_C"]
        StoreClient(b).set_peers([b, c], 1)
    dist.barrier()
    tenplex.save(build(LAYOUTS["tp2pp2"], rank, 2, False), job="stages", step=1, process_group=world)
    if rank == 0:
        out["persist"] = tenplex.persist("stages", None, os.environ["TENPLEX_TEST_DCP"])
        os.kill(int(os.environ["TENPLEX_TEST_KILL_PID"]), signal.SIGKILL)
        time.sleep(0.2)
    dist.barrier()
    if rank < 2:
        lay = LAYOUTS["tp2"]

        def from_replicas() -> dict:
            target = build(lay, rank, 1, True)
            info = tenplex.load(target, job="replicas", process_group=pair)
            return {"bad": check(target, 1), "lost": info.lost_stores, "bytes": info.bytes}

        def via_store_replica() -> dict:
            target = build(lay, rank, 2, True)
            info = tenplex.load(target, job="stages", process_group=pair)
            return {"bad": check(target, 2), "lost": info.lost_stores, "source": info.source,
                    "replaced": info.replaced}  # fmt: skip

        out["dp_replicas"] = attempt(from_replicas)
        out["store_replica"] = attempt(via_store_replica)
    dist.barrier()
    if rank == 0:
        os.kill(int(os.environ["TENPLEX_TEST_KILL_PID2"]), signal.SIGKILL)  # C too: stage 1 is gone
        time.sleep(0.2)
    dist.barrier()
    if rank < 2:
        lay = LAYOUTS["tp2"]

        def unrecoverable() -> dict:
            target = build(lay, rank, 2, True)
            try:
                tenplex.load(target, job="stages", process_group=pair)
            except UnrecoverableError as e:
                return {"message": str(e), "boxes": e.boxes}
            return {"message": "no error"}

        def durable() -> dict:
            target = build(lay, rank, 2, True)
            info = tenplex.load(target, job="stages", path=os.environ["TENPLEX_TEST_DCP"], process_group=pair)
            return {"bad": check(target, 2), "source": info.source, "note": info.note}

        out["unrecoverable"] = attempt(unrecoverable)
        out["durable"] = attempt(durable)
    dist.barrier()
    write_result(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
