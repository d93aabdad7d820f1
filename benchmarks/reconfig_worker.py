"""One rank of benchmarks/bench_reconfig.py: every reconfiguration case in one 4-rank gloo world.

For each case the rank builds its part of the reference GPT's state (parameters + AdamW moments as
DTensors in the source layout, plus plain values), then times, between barriers:

- tenplex: `save` into its host's store, `load` into the target layout;
- central mode (the paper's Tenplex-Central): `save(store=<host 0's store>)` (every rank's shards into
  host 0's store, over the network from the other hosts), then `load(central=True)` from it; and, for
  `x_central_load`, `load(central=True)` of tenplex's locally saved snapshot (only the load through host 0);
- PyTorch DCP: `dcp.save` -> `dcp.load` through a local-disk directory (fsync'd) and through /dev/shm.
- `dcp_tenplex`: DCP's planner on tenplex's stores (`tenplex.dcp.StoreWriter` / `StoreReader`).

A case may leave out central mode (`"central": false`) and run only some DCP baselines (`"dcp"`: a list of
"tenplex", "disk", "shm"), and with `"store_stats": true` rank 0 records every store's stats after the load
(benchmarks/bench_sweep.py: what a store holds per byte of state).

Every load is checked element for element against the values the source was built from. Meshes are built
without communicators and DTensors from local chunks, so nothing but tenplex and DCP communicates.
Results (per rank) go to $TENPLEX_BENCH_OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import tenplex
from tenplex.ptc.gpt import GPTConfig, param_shapes, stage_layers
from tenplex.store import StoreClient
from tenplex.transformer.stores import client

KINDS = {"param": 0.0, "exp_avg": 0.25, "exp_avg_sq": 0.5}  # salt per kind of tensor
PARAM_GROUPS = [{"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}]


def world_of(layout: list[int]) -> int:
    return layout[0] * layout[1] * layout[2]


def stage_of(where: str, cfg: GPTConfig, pp: int) -> int:
    if where == "first":
        return 0
    if where == "last":
        return pp - 1
    return next(s for s in range(pp) if int(where) in stage_layers(cfg.layers, pp, s))


def values(shape: tuple, offset: tuple, local_shape: tuple, salt: float) -> torch.Tensor:
    """The global tensor's values at this box: row * cols + col + salt, computed elementwise in fp32, so
    any rank computes the same value for the same global element whatever its shard."""
    if not local_shape:
        return torch.tensor(salt, dtype=torch.float32)
    rows = torch.arange(offset[0], offset[0] + local_shape[0], dtype=torch.float32)
    if len(shape) == 1:
        return rows + salt
    cols = torch.arange(offset[1], offset[1] + local_shape[1], dtype=torch.float32)
    return (rows[:, None] * float(shape[1]) + cols[None, :]) + salt


def build(cfg: GPTConfig, layout: list[int], rank: int, zeros: bool) -> dict:
    """This rank's state dict in `layout` = (dp, tp, pp): DTensors on a (dp, tp) mesh of its stage."""
    dp, tp, pp = layout
    stage = rank // (dp * tp)
    ranks = torch.arange(stage * dp * tp, (stage + 1) * dp * tp).reshape(dp, tp)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"), _init_backend=False)
    model: dict = {}
    state: dict = {}
    for fqn, shape, tpdims, where in param_shapes(cfg):
        if stage_of(where, cfg, pp) != stage:
            continue
        pl = [Replicate(), Shard(tpdims["tp"]) if "tp" in tpdims else Replicate()]
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, pl)
        stride = torch.empty(shape, device="meta").stride()
        st: dict = {"step": 100.0}
        for kind, salt in KINDS.items():
            s = salt + (zlib.crc32(fqn.encode()) % 1000)
            local = torch.zeros(local_shape) if zeros else values(shape, offset, local_shape, s)
            dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=torch.Size(shape), stride=stride)
            if kind == "param":
                model[fqn] = dt
            else:
                st[kind] = dt
        state[fqn] = st
    return {
        "model": model,
        "optim": {"state": state, "param_groups": [dict(g) for g in PARAM_GROUPS]},
        "step": 0 if zeros else 100,
    }


def zero(sd: dict) -> None:
    for dt in tensors(sd):
        dt.to_local().zero_()
    sd["step"] = 0


def tensors(sd: dict) -> list[DTensor]:
    out = list(sd["model"].values())
    for st in sd["optim"]["state"].values():
        out += [st["exp_avg"], st["exp_avg_sq"]]
    return out


def check(sd: dict) -> list[str]:
    """Names whose local shard differs from the values the source was built from."""
    bad = []
    for fqn, dt in sd["model"].items():
        st = sd["optim"]["state"][fqn]
        for kind, t in (("param", dt), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])):
            local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            s = KINDS[kind] + (zlib.crc32(fqn.encode()) % 1000)
            if not torch.equal(t.to_local(), values(tuple(t.shape), tuple(offset), tuple(local_shape), s)):
                bad.append(f"{fqn}.{kind}")
        if st["step"] != 100.0:
            bad.append(f"{fqn}.step={st['step']}")
    if sd["step"] != 100:
        bad.append(f"step={sd['step']}")
    return bad[:5]


def local_bytes(sd: dict) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in tensors(sd))


def timed(fn, active: bool, nic: dict | None = None) -> tuple[float | None, object]:
    """Run `fn` on the active ranks between two barriers of the whole world; this rank's seconds. With
    `nic`, this rank's host interface counters' growth over the two barriers goes into it."""
    dist.barrier()
    before = nic_bytes()
    t = time.perf_counter()
    out = fn() if active else None
    seconds = time.perf_counter() - t if active else None
    dist.barrier()
    if nic is not None and before is not None:
        after = nic_bytes()
        nic.update(bytes_in=after[0] - before[0], bytes_out=after[1] - before[1])
    return seconds, out


def nic_bytes() -> tuple[int, int] | None:
    """(received, sent) bytes of this namespace host's interface; None outside namespace hosts."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or not os.environ.get("TENPLEX_BENCH_HOST"):
        return None
    stats = Path("/sys/class/net") / ifname / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def evict(directory: Path) -> None:
    """Drop the checkpoint's pages from the page cache (our files only), so the next read comes from disk."""
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run_dcp(src, dst, root: Path, ga, gb, in_a: bool, in_b: bool, disk: bool, rank: int) -> dict:
    """dcp.save of the source layout, then dcp.load into the target layout through `root`."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    path = root / "ckpt"
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    out: dict = {}

    def save() -> None:
        # sync_files=True (the default): every data file and the metadata file are fsync'd; the directory
        # entry too, below, so the checkpoint survives a crash of the machine.
        dcp.save(src, storage_writer=FileSystemWriter(path, sync_files=True), process_group=ga)
        if dist.get_rank(ga) == 0:
            fsync_dir(path)

    def load() -> None:
        dcp.load(dst, storage_reader=FileSystemReader(path), process_group=gb)

    out["save"], _ = timed(save, in_a)
    if disk:
        if rank == 0:
            evict(path)
        zero_b(dst, in_b)
        out["load_cold"], _ = timed(load, in_b)
    zero_b(dst, in_b)
    out["load"], _ = timed(load, in_b)
    out["bad"] = check(dst) if in_b else []
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return out


def run_dcp_tenplex(src, dst, job: str, ga, gb, in_a: bool, in_b: bool, rank: int) -> dict:
    """DCP's planner on tenplex's stores: dcp.save through StoreWriter, dcp.load through StoreReader."""
    from tenplex.dcp import StoreReader, StoreWriter

    out: dict = {}
    out["save"], _ = timed(lambda: dcp.save(src, storage_writer=StoreWriter(job, 1), process_group=ga), in_a)
    zero_b(dst, in_b)
    reader = StoreReader(job, process_group=gb)
    out["load"], _ = timed(lambda: dcp.load(dst, storage_reader=reader, process_group=gb), in_b)
    out["bad"] = check(dst) if in_b else []
    dist.barrier()
    return out


def zero_b(dst: dict | None, in_b: bool) -> None:
    if in_b:
        zero(dst)


def run_case(case: dict, cfg: GPTConfig, groups: dict, rank: int, stores: dict, dirs: dict, tag: str) -> dict:
    la, lb, hosts = case["src"], case["dst"], case["hosts"]
    wa, wb = world_of(la), world_of(lb)
    in_a, in_b = rank < wa, rank < wb
    ga, gb = groups[wa], groups[wb]
    if "rank_stores" in stores:  # namespace hosts: every rank's own host store
        os.environ["TENPLEX_STORE"] = stores["rank_stores"][rank]
    else:
        os.environ["TENPLEX_STORE"] = stores["a"] if hosts == 1 or rank < 2 else stores["b"]
    job = f"reconfig-{case['name']}-{hosts}h-{tag}"
    hub = stores["rank_stores"][0] if "rank_stores" in stores else stores["a"]  # central mode's host 0
    src = build(cfg, la, rank, zeros=False) if in_a else None
    dst = build(cfg, lb, rank, zeros=True) if in_b else None
    res: dict = {"rank": rank, "src_bytes": local_bytes(src) if in_a else 0,
                 "host": os.environ.get("TENPLEX_BENCH_HOST"), "nic_load": {}, "nic_central_save": {},
                 "nic_central": {}, "nic_central_local": {}}  # fmt: skip
    own = os.environ["TENPLEX_STORE"]
    res["paths"] = {"own_store_shm": client(own).is_local, "hub_shm": client(hub).is_local,
                    "huge_pages": client(own).health().get("huge_pages")}  # fmt: skip

    t_save, handle = timed(lambda: tenplex.save(src, job=job, step=1, process_group=ga), in_a)
    res["save"] = t_save
    res["saved_bytes"] = handle.bytes_written if handle else 0
    res["save_phases"] = handle.phases if handle else {}
    t_load, info = timed(lambda: tenplex.load(dst, job=job, process_group=gb), in_b, res["nic_load"])
    res["load"] = t_load
    if info is not None:
        res["bytes"], res["plan_bytes"], res["load_inner"] = info.bytes, info.plan_bytes, info.seconds
        res["load_phases"] = info.phases
        res["bad"] = check(dst)
    zero_b(dst, in_b)
    if case.get("store_stats") and rank == 0:  # what every store holds with the snapshot and relay caches
        res["store_stats"] = {u: StoreClient(u).stats() for u in all_stores(stores)}
    if case.get("central", True):
        run_central(res, src, dst, job, hub, ga, gb, in_a, in_b)
    kinds = dcp_kinds(case)
    if "tenplex" in kinds:
        res["dcp_tenplex"] = run_dcp_tenplex(src, dst, f"{job}-dcp", ga, gb, in_a, in_b, rank)
    dist.barrier()
    if rank == 0:
        for url in all_stores(stores):
            for j in (job, f"{job}-dcp", f"{job}-central"):
                if j in StoreClient(url).jobs():
                    StoreClient(url).delete_job(j)
    if "disk" in kinds:
        res["dcp_disk"] = run_dcp(src, dst, dirs["disk"], ga, gb, in_a, in_b, True, rank)
    if "shm" in kinds:
        res["dcp_shm"] = run_dcp(src, dst, dirs["shm"], ga, gb, in_a, in_b, False, rank)
    dist.barrier()
    return res


def all_stores(stores: dict) -> list[str]:
    return sorted(set(stores.get("rank_stores", [])) | {stores["a"], stores["b"]})


def dcp_kinds(case: dict) -> list[str]:
    """The DCP baselines a case runs: `dcp` true (all three), false (none) or a list of them."""
    dcp = case.get("dcp", True)
    return ["tenplex", "disk", "shm"] if dcp is True else list(dcp or [])


def run_central(res: dict, src, dst, job: str, hub: str, ga, gb, in_a: bool, in_b: bool) -> None:
    """Central mode, timed into `res`: the load of the local snapshot through host 0, then the original's
    Tenplex-Central (save into host 0's store, load from it)."""
    # central mode with the snapshot saved locally: only the load goes through host 0 (`x_central_load`)
    t_local, info_l = timed(
        lambda: tenplex.load(dst, job=job, central=True, process_group=gb), in_b, res["nic_central_local"]
    )
    res["central_local_load"] = t_local
    res["bad_central"] = check(dst) if info_l is not None else []
    # central mode as the original's Tenplex-Central: every rank saves into host 0's store (over the
    # network from the other hosts), and every rank loads from it
    t_csave, _ = timed(lambda: tenplex.save(src, job=f"{job}-central", step=1, store=hub, process_group=ga),
                       in_a, res["nic_central_save"])  # fmt: skip
    res["central_save"] = t_csave
    zero_b(dst, in_b)
    t_central, info_c = timed(lambda: tenplex.load(dst, job=f"{job}-central", central=True, process_group=gb),
                              in_b, res["nic_central"])  # fmt: skip
    res["central_load"] = t_central
    if info_c is not None:
        res["central_bytes"] = info_c.bytes
        res["bad_central"] += check(dst)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = json.loads(os.environ["TENPLEX_BENCH_SPEC"])
    sizes = {1, 2, 4} | {world_of(c[k]) for c in spec["cases"] for k in ("src", "dst")}
    groups = {k: dist.new_group(list(range(k))) for k in sorted(sizes)}
    cfg = GPTConfig(**spec["model"])
    stores = {"a": spec["store_a"], "b": spec["store_b"]}
    if spec.get("rank_stores"):
        stores["rank_stores"] = spec["rank_stores"]
    dirs = {"disk": Path(spec["disk_dir"]), "shm": Path(spec["shm_dir"])}
    out = Path(os.environ["TENPLEX_BENCH_OUT"])
    # warm-up, untimed: first store writes, first DCP save/load, imports on first use
    tiny = GPTConfig(layers=4, hidden=64, heads=4, vocab=256, seq=64)
    first = {k: spec["cases"][0][k] for k in ("central", "dcp") if k in spec["cases"][0]}  # what cases run
    for hosts in (1, 2) if not spec.get("rank_stores") else (spec["cases"][0]["hosts"],):
        warm = {"name": "warmup", "src": [1, 2, 2], "dst": [2, 1, 2], "hosts": hosts, **first}
        run_case(warm, tiny, groups, rank, stores, dirs, "warmup")
    results = []
    for case in spec["cases"]:
        t = time.perf_counter()
        reps = [run_case(case, cfg, groups, rank, stores, dirs, str(i)) for i in range(spec["repeat"])]
        results.append({"case": case, "reps": reps})
        if rank == 0:
            print(f"  {case['name']} {case['hosts']}h done in {time.perf_counter() - t:.1f} s", flush=True)
        (out / f"rank{rank}.json").write_text(json.dumps(results))  # partial results survive a crash
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
