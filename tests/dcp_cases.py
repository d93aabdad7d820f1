"""Worker for tests/test_dcp.py: DCP through the tensor stores in a 4-rank gloo world.

Ranks 0-1 are on emulated host A, ranks 2-3 on host B. The source is a small model with tensor parallelism
(tp 2) and FSDP2 (dp 2) on a real 2-D mesh, as torchtitan builds it; the target is the same model with
FSDP2 alone on ranks 0-2 (uneven shards, no TP). Each door is compared bit for bit with DCP through the
file system on the same state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tenplex
from launch import write_result
from tenplex.dcp import StoreReader, StoreWriter
from tenplex.transformer.fetch import HeldBoxes


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)
        self.register_buffer("table", torch.arange(7.0))


def source() -> nn.Module:
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        model.table.mul_(3)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def target(group) -> nn.Module:
    torch.manual_seed(1)
    model = Tiny()
    fully_shard(model, mesh=DeviceMesh.from_group(group, "cpu"))
    with torch.no_grad():
        for t in model.state_dict().values():
            (t.to_local() if isinstance(t, DTensor) else t).zero_()
    return model


def state(model: nn.Module, step: int) -> dict:
    return {"model": model.state_dict(), "step": step, "meta": {"betas": (0.9, 0.95), "tags": ["a", 1]}}


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def compare(got: dict, want: dict, full: dict) -> list[str]:
    """Keys whose local tensor differs (bitwise) from the file-system load or from the source."""
    bad = []
    for k, t in got["model"].items():
        a, b = local(t), local(want["model"][k])
        if not torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b):
            bad.append(f"{k}: differs from the file-system load")
        if isinstance(t, DTensor) and not torch.equal(t.full_tensor(), full[k]):
            bad.append(f"{k}: differs from the source")
    for k in ("step", "meta"):
        if got[k] != want[k]:
            bad.append(f"{k}: {got[k]!r} != {want[k]!r}")
    return bad


def relay(rank: int) -> dict:
    """Saved by host B's ranks alone, loaded by host A's two ranks: each range crosses once, via A's store."""
    a, b = os.environ["DCP_TEST_STORES"].split(",")
    pairs = [dist.new_group([2, 3]), dist.new_group([0, 1])]
    weight = torch.arange(4 * 8192.0).reshape(4, 8192)  # 128 KiB: a shared box that small would go direct
    if rank >= 2:
        dcp.save({"w": weight, "n": 5}, storage_writer=StoreWriter("relayjob", 1), process_group=pairs[0])
    dist.barrier()
    res: dict = {}
    if rank < 2:
        got = {"w": torch.zeros(4, 8192), "n": 0}
        reader = StoreReader("relayjob", sources=[b], process_group=pairs[1])
        dcp.load(got, storage_reader=reader, process_group=pairs[1])
        res = {"equal": torch.equal(got["w"], weight) and got["n"] == 5, "relayed": reader.relayed}
        dist.barrier(pairs[1])
        res["left"] = relay_left(a)
    dist.barrier()
    return res


def relay_left(url: str, within: float = 10.0) -> int:
    """The store's relay cache entries, once the load's drop (sent without waiting) got there."""
    stats = tenplex.store.StoreClient(url).stats
    deadline = time.monotonic() + within
    while (left := stats()["relay_blobs"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return left


def same_plan(rank: int) -> dict:
    """`tenplex.save` on a (tp 2, dp 2) mesh whose tp halves lie one per host, then one target (w split by
    columns, b and c replicated, on 4 ranks) loaded through `tenplex.load` and through `StoreReader`: each
    rank's reads as the executor ran them (which rank's store serves which box to which rank, by which
    route), and whether both doors filled the same bytes, the source's."""
    full = {"w": torch.arange(32.0).reshape(8, 4), "b": torch.arange(6.0) + 100,
            "c": torch.arange(12.0).reshape(4, 3) * 2}  # fmt: skip
    src = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    placed = {"w": [Shard(0), Replicate()], "b": [Shard(0), Replicate()], "c": [Replicate(), Shard(0)]}
    tenplex.save({n: distribute_tensor(t, src, placed[n]) for n, t in full.items()}, job="planjob", step=1)
    dst = init_device_mesh("cpu", (4,))
    into = {"w": [Shard(1)], "b": [Replicate()], "c": [Replicate()]}
    seen: list[list] = []
    real = HeldBoxes.read

    def spy(held: HeldBoxes, reads: list) -> None:
        seen.extend([r.fetch.tensor, str(r.fetch.box), r.fetch.dst, r.fetch.src, r.fetch.route.value,
                     r.store.url, r.peer or ""] for r in reads)  # fmt: skip
        real(held, reads)

    got, plans = [], []
    HeldBoxes.read = spy
    try:
        for door in ("tenplex.load", "StoreReader"):
            sd = {n: distribute_tensor(torch.zeros_like(t), dst, into[n]) for n, t in full.items()}
            if door == "tenplex.load":
                tenplex.load(sd, job="planjob")
            else:
                dcp.load(sd, storage_reader=StoreReader("planjob"))
            got.append(sd)
            plans.append(sorted(seen))
            seen.clear()
    finally:
        HeldBoxes.read = real
    same = all(torch.equal(got[0][n].to_local().view(torch.uint8), got[1][n].to_local().view(torch.uint8))
               and torch.equal(got[1][n].full_tensor(), full[n]) for n in full)  # fmt: skip
    return {"load": plans[0], "dcp": plans[1], "equal": same}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    three = dist.new_group([0, 1, 2])
    out: dict = {}
    tmp = tempfile.mkdtemp(prefix="tenplex-dcp-") if rank == 0 else None
    path = [tmp]
    dist.broadcast_object_list(path)
    path = path[0]
    try:
        model = source()
        sd = state(model, 7)
        full = {k: t.full_tensor() if isinstance(t, DTensor) else t.clone() for k, t in sd["model"].items()}
        out["placements"] = sorted({type(p).__name__ for t in sd["model"].values() if isinstance(t, DTensor)
                                    for p in t.placements})  # fmt: skip
        dcp.save(sd, storage_writer=StoreWriter("dcpjob", 10))
        dcp.save(sd, checkpoint_id=os.path.join(path, "fs"))
        tenplex.save(state(model, 7), job="tenplexjob", step=3)
        fut = dcp.async_save(state(model, 8), storage_writer=StoreWriter("asyncjob", 4))
        fut.result()
        dist.barrier()

        if rank < 3:
            reference = state(target(three), 0)
            dcp.load(reference, checkpoint_id=os.path.join(path, "fs"), process_group=three)
            cases = {}
            reader = StoreReader("dcpjob", process_group=three)
            got = state(target(three), 0)
            dcp.load(got, storage_reader=reader, process_group=three)
            cases["dcp->dcp"] = compare(got, reference, full)
            out["relayed"] = reader.relayed
            out["chosen"] = reader.chosen_step

            got = state(target(three), 0)
            dcp.load(got, storage_reader=StoreReader("tenplexjob", process_group=three), process_group=three)
            cases["tenplex.save->dcp"] = compare(got, reference, full)

            got = state(target(three), 0)
            tenplex.load(got, job="dcpjob", process_group=three)
            cases["dcp->tenplex.load"] = compare(got, reference, full)

            got = state(target(three), 0)
            dcp.load(got, storage_reader=StoreReader("asyncjob", 4, process_group=three), process_group=three)
            cases["async_save->dcp"] = compare(got, {**reference, "step": 8}, full)
            out["cases"] = cases

            try:
                dcp.load(state(target(three), 0), storage_reader=StoreReader("never", process_group=three),
                         process_group=three)  # fmt: skip
                out["missing"] = "loaded"
            except CheckpointException as e:
                out["missing"] = sorted({type(exc).__name__ for exc, _ in e.failures.values()})
                out["missing_msg"] = str(next(iter(e.failures.values()))[0])
        dist.barrier()
        out["relay"] = relay(rank)
        out["same_plan"] = same_plan(rank)
        out["ok"] = True
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    write_result(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
