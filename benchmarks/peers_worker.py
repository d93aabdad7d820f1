"""One rank of benchmarks/bench_peers.py: every case of one 4-rank gloo world, every system on the same state.

- `recovery` (HSDP: replicas of a 2-way Shard(0) state): ranks 0-1 are the healthy replica (host A), ranks
  2-3 the one that rejoins (host B) and takes its state, each rank from its peer r - 2: tenplex `save` on
  0-1 + `load` on 2-3; torchft's HTTPTransport (one run per chunk count) and PGTransport (torchft's own
  gloo ProcessGroup per pair of peers, received in place); DCP save on 0-1 + load on 2-3 through /dev/shm
  and disk.
- `fsdp` (Shard(0) on 4 ranks -> 3) and `dp` (2 replicas -> 4): tenplex `save` + `load`, DCP through /dev/shm
  (ByteCheckpoint runs in its own worlds under its own torch: benchmarks/peers_bytecheckpoint.py).

Every step is timed between barriers of the whole world (the slowest rank counts) and every receiving rank's
tensors are checked against the values the source was built from. Results: $TENPLEX_BENCH_OUT/rank<r>.json.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import tenplex
from peers_state import build, check, copy_into, layout, local_bytes, zero
from reconfig_worker import evict, fsync_dir, timed
from tenplex.ptc.gpt import GPTConfig
from tenplex.store import StoreClient

TIMEOUT = timedelta(seconds=600)
S3_BUCKET = "tenplex-bench"
# (source mesh, target mesh) per case, as (replicate, shard, first rank)
CASES = {
    "recovery": ((1, 2, 0), (1, 2, 2)),
    "fsdp": ((1, 4, 0), (1, 3, 0)),
    "dp": ((2, 1, 0), (4, 1, 0)),
}


def members(mesh: tuple[int, int, int]) -> list[int]:
    return [r for row in layout(*mesh) for r in row]


class World:
    """The rank, its process groups (one per set of ranks a case uses) and where things go."""

    def __init__(self, spec: dict) -> None:
        self.rank = dist.get_rank()
        self.spec = spec
        sets = sorted({tuple(members(m)) for pair in CASES.values() for m in pair})
        self.groups = {s: dist.new_group(list(s)) for s in sets}

    def group(self, mesh: tuple[int, int, int]):
        return self.groups[tuple(members(mesh))]


def run_tenplex(w: World, job: str, src, dst, a, b, atomic: bool = True) -> dict:
    """`atomic=False`: the load lands its boxes straight in `dst` (zeroed first, so that its check proves
    the bytes came), as a rejoining replica may."""
    in_a, in_b = src is not None, dst is not None
    out: dict = {}
    out["save"], handle = timed(lambda: tenplex.save(src, job=job, step=1, process_group=w.group(a)), in_a)
    if in_b and not atomic:
        zero(dst)
    out["load"], info = timed(
        lambda: tenplex.load(dst, job=job, process_group=w.group(b), atomic=atomic), in_b
    )
    out["saved_bytes"] = handle.bytes_written if handle else 0
    if info is not None:
        out["bytes"], out["bad"], out["load_phases"] = info.bytes, check(dst), info.phases
    dist.barrier()
    if w.rank == 0:
        for url in {w.spec["store_a"], w.spec["store_b"], *w.spec.get("rank_stores", [])}:
            if job in StoreClient(url).jobs():
                StoreClient(url).delete_job(job)
    return out


class Target:
    """Where a DCP checkpoint goes: a directory (/dev/shm, or a disk, fsync'd) or an S3 bucket (DCP's fsspec
    storage through s3fs, an S3-compatible server's `endpoint`)."""

    def __init__(self, where: str, disk: bool = False, endpoint: str | None = None) -> None:
        self.where, self.disk, self.endpoint = where, disk, endpoint

    def fresh(self) -> None:
        """An empty checkpoint location (rank 0, before the save)."""
        if self.endpoint:
            fs = self._s3()
            if not fs.exists(S3_BUCKET):
                fs.mkdir(S3_BUCKET)
            return
        shutil.rmtree(self.where, ignore_errors=True)
        Path(self.where).mkdir(parents=True)

    def writer(self):
        if self.endpoint:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            return FsspecWriter(self.where, sync_files=False, **self._options())
        return FileSystemWriter(self.where, sync_files=self.disk)

    def reader(self):
        if self.endpoint:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(self.where, **self._options())
        return FileSystemReader(self.where)

    def saved(self, first_of_savers: bool) -> None:
        """After the save: on disk, the directory entry made durable and the pages dropped (a recovering host
        reads what another host wrote: not from its page cache)."""
        if self.disk and first_of_savers:
            fsync_dir(Path(self.where))
            evict(Path(self.where))

    def remove(self) -> None:
        if self.endpoint:
            self._s3().rm(self.where, recursive=True)
        else:
            shutil.rmtree(self.where, ignore_errors=True)

    def _options(self) -> dict:
        # moto takes any credentials and region (us-east-1 would make s3fs send a constraint S3 rejects)
        return {"endpoint_url": self.endpoint, "key": "bench", "secret": "bench",
                "client_kwargs": {"region_name": "eu-west-1"}}  # fmt: skip

    def _s3(self):
        import s3fs

        return s3fs.S3FileSystem(**self._options())


def run_dcp(w: World, target: Target, src, dst, a, b) -> dict:
    """dcp.save by the source ranks, dcp.load by the target ranks, through `target`."""
    if w.rank == 0:
        target.fresh()
    ga, gb = w.group(a), w.group(b)

    def save() -> None:
        dcp.save(src, storage_writer=target.writer(), process_group=ga)
        target.saved(dist.get_rank(ga) == 0)

    out: dict = {}
    out["save"], _ = timed(save, src is not None)
    if dst is not None:
        zero(dst)
    out["load"], _ = timed(lambda: dcp.load(dst, storage_reader=target.reader(), process_group=gb),
                           dst is not None)  # fmt: skip
    out["bad"] = check(dst) if dst is not None else []
    dist.barrier()
    if w.rank == 0:
        target.remove()
    return out


def run_http(w: World, chunks: int, src, dst, step: int) -> dict:
    """torchft's HTTPTransport: each healthy rank serves its state, its peer fetches it (in `chunks` parallel
    requests; 0: one request, the torchft Manager's default) and copies it into its own tensors, as the
    model's and optimizer's load_state_dict would. Every rank's transport (and server) starts untimed."""
    from torchft.checkpointing.http_transport import HTTPTransport

    # torchft's request handler logs every request to stderr (a chunk sweep: hundreds of lines)
    http.server.BaseHTTPRequestHandler.log_message = lambda *a, **k: None
    transport = HTTPTransport(timeout=TIMEOUT, num_chunks=chunks)
    ports = [None] * dist.get_world_size()
    dist.all_gather_object(ports, transport._server.socket.getsockname()[1])
    peer = w.rank - 2
    # the peer's address: its namespace host's, or loopback (torchft would name the host)
    addr = w.spec.get("rank_addrs", ["127.0.0.1"] * 4)[peer]
    url = f"http://{addr}:{ports[peer]}/checkpoint/" if peer >= 0 else ""
    if dst is not None:
        zero(dst)

    def move() -> None:
        if src is not None:
            transport.send_checkpoint(dst_ranks=[w.rank + 2], step=step, state_dict=src, timeout=TIMEOUT)
        else:
            copy_into(dst, transport.recv_checkpoint(src_rank=peer, metadata=url, step=step, timeout=TIMEOUT))

    seconds, _ = timed(move, True)
    out = {"load": seconds, "bad": check(dst) if dst is not None else []}
    dist.barrier()
    transport.shutdown()
    return out


def run_pg(w: World, src, dst, step: int, tag: str) -> dict:
    """torchft's PGTransport over torchft's gloo ProcessGroup, one per pair of peers (r, r + 2), configured
    before the timed part (torchft's quorum does that); the receiver gets the state in place."""
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    pair = w.rank % 2
    addr = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/torchft/{tag}/pair{pair}"
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    pg.configure(addr, replica_id=str(w.rank // 2), rank=w.rank // 2, world_size=2)
    mine = dst
    transport = PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu"), state_dict=lambda: mine)
    if dst is not None:
        zero(dst)

    def send() -> None:
        transport.send_checkpoint(dst_ranks=[1], step=step, state_dict=src, timeout=TIMEOUT)

    def receive() -> None:
        transport.recv_checkpoint(src_rank=0, metadata="<n/a>", step=step, timeout=TIMEOUT)

    seconds, _ = timed(send if src is not None else receive, True)
    out = {"load": seconds, "bad": check(dst) if dst is not None else []}
    dist.barrier()
    pg.shutdown()
    return out


def run_case(w: World, name: str, cfg: GPTConfig, rep: int) -> dict:
    a, b = CASES[name]
    src = build(cfg, layout(*a), w.rank, zeros=False) if w.rank in members(a) else None
    dst = build(cfg, layout(*b), w.rank, zeros=True) if w.rank in members(b) else None
    if "rank_stores" in w.spec:  # namespace hosts: every rank's own host's store
        os.environ["TENPLEX_STORE"] = w.spec["rank_stores"][w.rank]
    else:  # recovery: the rejoining replica on host B; resharding on one host
        two = name == "recovery" and w.rank >= 2
        os.environ["TENPLEX_STORE"] = w.spec["store_b"] if two else w.spec["store_a"]
    tag = f"{name}-{rep}"
    res: dict = {"rank": w.rank, "src_bytes": local_bytes(src) if src else 0,
                 "dst_bytes": local_bytes(dst) if dst else 0}  # fmt: skip
    res["tenplex"] = run_tenplex(w, f"peers-{tag}", src, dst, a, b)
    if name == "recovery":
        res["tenplex_direct"] = run_tenplex(w, f"peers-{tag}-direct", src, dst, a, b, atomic=False)
    res["dcp_shm"] = run_dcp(w, Target(f"{w.spec['shm_dir']}/ckpt"), src, dst, a, b)
    if name == "recovery":
        res["dcp_disk"] = run_dcp(w, Target(f"{w.spec['disk_dir']}/ckpt", disk=True), src, dst, a, b)
        if w.spec.get("s3"):
            res["dcp_s3"] = run_dcp(
                w, Target(f"s3://{S3_BUCKET}/{tag}", endpoint=w.spec["s3"]), src, dst, a, b
            )
        for chunks in w.spec["http_chunks"] if w.spec["torchft"] else []:
            res[f"http_{chunks}"] = run_http(w, chunks, src, dst, step=rep + 1)
        if w.spec["torchft"]:
            res["pg"] = run_pg(w, src, dst, rep + 1, tag)
    dist.barrier()
    return res


def main() -> None:
    dist.init_process_group("gloo")
    spec = json.loads(os.environ["TENPLEX_BENCH_SPEC"])
    w = World(spec)
    out = Path(os.environ["TENPLEX_BENCH_OUT"])
    tiny = GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=64)
    for name in spec["cases"]:  # warm-up, untimed: first store writes, imports, first connections
        run_case(w, name, tiny, -1)
    cfg = GPTConfig(**spec["model"])
    results = []
    for name in spec["cases"]:
        t = time.perf_counter()
        results.append({"case": name, "reps": [run_case(w, name, cfg, i) for i in range(spec["repeat"])]})
        if w.rank == 0:
            print(f"  {name} done in {time.perf_counter() - t:.1f} s", flush=True)
        (out / f"rank{w.rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
