"""Worker for tests/test_transformer.py: runs every resharding case in one 4-rank gloo world.

Ranks 0-1 live on emulated host A (one store), ranks 2-3 on host B (another store): traffic between them
takes the network path. Layouts with fewer ranks use process groups over the first ranks; meshes are built
without communicators and DTensors from local chunks, so no case needs collectives of its own.
"""

from __future__ import annotations

import os
import traceback
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import tenplex
from launch import write_result
from tenplex.transformer import KeyMismatchError, ShapeMismatchError

TENSORS = {  # name: (shape, dtype)
    "model.emb.weight": ((10, 6), torch.float32),
    "model.lin.weight": ((7, 13), torch.float32),
    "model.lin.bias": ((7,), torch.float32),
    "model.out.weight": ((5, 7), torch.bfloat16),
    "optim.state.lin.weight.exp_avg": ((7, 13), torch.float32),
    "optim.state.lin.weight.step": ((), torch.float32),
    "buffers.counts": ((9,), torch.int64),
}
NAMES = sorted(TENSORS)


def global_tensor(name: str, salt: int = 0) -> torch.Tensor:
    shape, dtype = TENSORS[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{salt}".encode()))
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def placements(name: str, fsdp: bool) -> list:
    shape = TENSORS[name][0]
    i = NAMES.index(name)
    tp = Replicate() if not shape else Shard(0 if len(shape) == 1 or i % 2 == 0 else 1)
    dp = Shard(0) if fsdp and shape else Replicate()
    return [dp, tp]


def stage_of(name: str, pp: int) -> int:
    return NAMES.index(name) * pp // len(NAMES)


def build(layout: tuple, rank: int, salt: int, zeros: bool) -> dict:
    """This rank's state dict of `layout` = (dp, tp, pp, fsdp): DTensors of its stage's tensors."""
    dp, tp, pp, fsdp = layout
    stage = rank // (dp * tp)
    ranks = torch.arange(stage * dp * tp, (stage + 1) * dp * tp).reshape(dp, tp)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "tp"), _init_backend=False)
    sd: dict = {"model": {}, "optim": {"state": {"lin.weight": {}}}, "buffers": {}}
    for name in NAMES:
        if stage_of(name, pp) != stage:
            continue
        full = global_tensor(name, salt)
        pl = placements(name, fsdp)
        local_shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, pl)
        index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        local = torch.zeros(local_shape, dtype=full.dtype) if zeros else full[index].clone()
        dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=full.shape, stride=full.stride())
        parts = name.split(".")
        if parts[0] == "optim":
            sd["optim"]["state"]["lin.weight"][parts[-1]] = dt
        else:
            sd[parts[0]][".".join(parts[1:])] = dt
    sd["step"] = 0 if zeros else 100 + salt
    sd["meta"] = {"betas": None, "tags": None} if zeros else {"betas": (0.9, 0.95), "tags": ["a", 1, None]}
    return sd


def check(sd: dict, salt: int) -> list[str]:
    """Every local shard equals the global tensor's slice, bit for bit; values equal the saved ones."""
    bad = []
    flat = {f"model.{k}": v for k, v in sd["model"].items()}
    flat |= {f"buffers.{k}": v for k, v in sd["buffers"].items()}
    flat |= {f"optim.state.lin.weight.{k}": v for k, v in sd["optim"]["state"]["lin.weight"].items()}
    for name, dt in flat.items():
        full = global_tensor(name, salt)
        local_shape, offset = compute_local_shape_and_global_offset(full.shape, dt.device_mesh, dt.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        if not torch.equal(dt.to_local(), full[index]):
            if os.environ.get("TENPLEX_TEST_DEBUG"):
                print(name, dt.to_local().flatten()[:4], full[index].flatten()[:4], flush=True)
            bad.append(name)
    if sd["step"] != 100 + salt or sd["meta"] != {"betas": (0.9, 0.95), "tags": ["a", 1, None]}:
        bad.append(f"values {sd['step']} {sd['meta']}")
    return bad


LAYOUTS = {
    "1": (1, 1, 1, False),
    "dp2": (2, 1, 1, False),
    "tp2": (1, 2, 1, False),
    "pp2": (1, 1, 2, False),
    "dp4": (4, 1, 1, False),
    "tp4": (1, 4, 1, False),
    "pp4": (1, 1, 4, False),
    "dp2tp2": (2, 2, 1, False),
    "dp2pp2": (2, 1, 2, False),
    "tp2pp2": (1, 2, 2, False),
    "fsdp2": (2, 1, 1, True),
    "fsdp2tp2": (2, 2, 1, True),
    "fsdp4": (4, 1, 1, True),
    "tp3": (1, 3, 1, False),
}
PAIRS = [
    ("1", "dp4"), ("dp4", "1"), ("tp2", "tp4"), ("tp4", "tp2"), ("pp2", "pp4"), ("pp4", "tp2pp2"),
    ("dp2tp2", "tp2pp2"), ("tp2pp2", "dp2pp2"), ("dp2pp2", "fsdp2tp2"), ("fsdp2tp2", "tp4"),
    ("fsdp4", "dp2tp2"), ("dp2", "fsdp2"), ("tp3", "fsdp4"), ("fsdp2", "tp3"), ("1", "tp2pp2"),
    ("dp2tp2", "dp2tp2"),
]  # fmt: skip


def world_of(layout: tuple) -> int:
    return layout[0] * layout[1] * layout[2]


def run_pairs(groups: dict[int, object], rank: int) -> dict:
    results = {}
    only = os.environ.get("TENPLEX_TEST_PAIRS")
    for i, (a, b) in enumerate(PAIRS):
        if only and f"{a}->{b}" not in only.split(","):
            continue
        la, lb = LAYOUTS[a], LAYOUTS[b]
        job, key = f"pair{i}", f"{a}->{b}"
        try:
            if rank < world_of(la):
                tenplex.save(build(la, rank, i, False), job=job, step=1, process_group=groups[world_of(la)])
            dist.barrier()
            bad, info = [], None
            if rank < world_of(lb):
                target = build(lb, rank, i, True)
                info = tenplex.load(target, job=job, process_group=groups[world_of(lb)])
                bad = check(target, i)
                # round trip: B saves, A loads it back
                tenplex.save(target, job=job, step=2, process_group=groups[world_of(lb)])
            dist.barrier()
            if rank < world_of(la):
                back = build(la, rank, i, True)
                tenplex.load(back, job=job, step=2, process_group=groups[world_of(la)])
                bad += [f"round trip: {x}" for x in check(back, i)]
            results[key] = {"bad": bad, "bytes": info.bytes if info else None}
        except Exception:
            results[key] = {"bad": [traceback.format_exc()]}
        dist.barrier()
    return results


def run_errors(groups: dict[int, object], rank: int) -> dict:
    """Strict and shape errors are raised on every rank before any tensor is touched."""
    out = {}
    lay = LAYOUTS["dp2"]
    if rank < 2:
        g = groups[2]
        tenplex.save(build(lay, rank, 50, False), job="errors", step=1, process_group=g)
        extra = build(lay, rank, 50, True)
        extra["model"]["unknown.weight"] = torch.zeros(3)
        try:
            tenplex.load(extra, job="errors", process_group=g)
            out["strict"] = "no error"
        except KeyMismatchError as e:
            out["strict"] = str(e)
        untouched = float(extra["model"]["emb.weight"].to_local().abs().sum())
        out["untouched"] = untouched
        info = tenplex.load(extra, job="errors", strict=False, process_group=g)
        out["nonstrict_missing"] = info.missing
        wrong = build(lay, rank, 50, True)
        wrong["model"]["lin.bias"] = torch.zeros(8)
        try:
            tenplex.load(wrong, job="errors", process_group=g)
            out["shape"] = "no error"
        except (ShapeMismatchError, KeyMismatchError) as e:
            out["shape"] = str(e)
        try:
            tenplex.load(build(lay, rank, 50, True), job="never-saved", process_group=g)
            out["nosnapshot"] = "no error"
        except tenplex.TenplexError as e:
            out["nosnapshot"] = str(e)
    dist.barrier()
    return out


def run_foreign_module(groups: dict[int, object], rank: int) -> dict:
    """A module written here, placed with DTensor by hand on a (2, 2) mesh, loaded on 3 ranks."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.up = torch.nn.Linear(6, 13)
            self.down = torch.nn.Linear(13, 7)

    def reference() -> tuple[Net, torch.optim.Optimizer]:
        torch.manual_seed(7)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, foreach=False)
        for p in net.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        return net, opt

    def placed(ranks: torch.Tensor, names: tuple, plan: dict, ref: Net, zero: bool) -> tuple:
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False)
        net = Net()
        for pname, p in ref.named_parameters():
            pl = plan[pname]
            local_shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, pl)
            index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
            local = torch.zeros(local_shape) if zero else p.detach()[index].clone()
            mod, attr = pname.rsplit(".", 1)
            dt = DTensor.from_local(local, mesh, pl, run_check=False, shape=p.shape, stride=p.stride())
            setattr(net.get_submodule(mod), attr, torch.nn.Parameter(dt))
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, foreach=False)
        for p in net.parameters():
            p.grad = DTensor.from_local(
                torch.full_like(p.to_local(), 0.5), mesh, p.placements, run_check=False,
                shape=p.shape, stride=p.stride(),
            )  # fmt: skip
        opt.step()  # elementwise on local shards: no communication
        if zero:  # a target holding nothing the load does not bring, so every comparison below can fail
            for st in opt.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k].to_local().zero_()
                st["step"].zero_()
        return net, opt

    ref, ref_opt = reference()
    out: dict = {}
    if rank < 4:
        two_by_two = {
            "emb.weight": [Shard(0), Replicate()],
            "up.weight": [Replicate(), Shard(0)],
            "up.bias": [Replicate(), Shard(0)],
            "down.weight": [Shard(1), Shard(0)],
            "down.bias": [Shard(0), Shard(0)],
        }
        net, opt = placed(torch.arange(4).reshape(2, 2), ("a", "b"), two_by_two, ref, zero=False)
        # the step above only created the state: set parameters and moments to the reference's slices
        for p, rp in zip(net.parameters(), ref.parameters()):
            st, rst = opt.state[p], ref_opt.state[rp]
            lshape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            idx = tuple(slice(o, o + n) for o, n in zip(off, lshape))
            p.to_local().detach().copy_(rp.detach()[idx])
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].to_local().copy_(rst[k][idx])
        tenplex.save({"model": net, "optim": opt}, job="foreign", step=3, process_group=groups[4])
    dist.barrier()
    if rank < 3:
        three = {
            "emb.weight": [Shard(1)],
            "up.weight": [Shard(0)],
            "up.bias": [Replicate()],
            "down.weight": [Shard(1)],
            "down.bias": [Shard(0)],
        }
        net, opt = placed(torch.arange(3), ("x",), three, ref, zero=True)
        tenplex.load({"model": net, "optim": opt}, job="foreign", process_group=groups[3])
        bad = []
        for (pname, p), rp in zip(net.named_parameters(), ref.parameters()):
            lshape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            idx = tuple(slice(o, o + n) for o, n in zip(off, lshape))
            if not torch.equal(p.to_local(), rp.detach()[idx]):
                bad.append(pname)
            for k in ("exp_avg", "exp_avg_sq"):
                if not torch.equal(opt.state[p][k].to_local(), ref_opt.state[rp][k][idx]):
                    bad.append(f"{pname}.{k}")
            if not torch.equal(opt.state[p]["step"], ref_opt.state[rp]["step"]):
                bad.append(f"{pname}.step")
        out["bad"] = bad
    dist.barrier()
    return out


def run_modes(groups: dict[int, object], rank: int) -> dict:
    """An asynchronous save, then a central load (every byte through host A's store)."""
    out: dict = {}
    handle = tenplex.save(build(LAYOUTS["dp2tp2"], rank, 60, False), job="modes", step=1, async_save=True)
    handle.wait(timeout=120)
    out["done"] = handle.done
    target = build(LAYOUTS["tp4"], rank, 60, True)
    info = tenplex.load(target, job="modes", central=True)
    out["bad"] = check(target, 60)
    out["bytes"] = info.bytes
    return out


def run_strided(rank: int) -> dict:
    """FSDP2-over-TP DTensors (`_StridedShard`, made by torch's own `distribute_tensor`), even and uneven,
    saved and loaded into Shard layouts and back into the strided one, compared bit for bit; a strided
    layout that interleaves a rank's rows is refused on every rank with a clear error."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(1)
    fulls = {"even": torch.randn(8, 6, generator=g), "uneven": torch.randn(11, 6, generator=g),
             "cols": torch.randn(5, 14, generator=g).to(torch.bfloat16)}  # fmt: skip
    dims = {"even": 0, "uneven": 0, "cols": 1}

    def strided(name: str, t: torch.Tensor) -> DTensor:
        d = dims[name]
        return distribute_tensor(t, mesh, [_StridedShard(d, split_factor=2), Shard(d)], src_data_rank=None)

    out: dict = {"bad": []}
    tenplex.save({n: strided(n, t) for n, t in fulls.items()}, job="strided", step=1)
    flat = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("x",), _init_backend=False)
    target = {}
    for n, t in fulls.items():
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, flat, [Shard(0)])
        target[n] = DTensor.from_local(torch.zeros(local_shape, dtype=t.dtype), flat, [Shard(0)],
                                       run_check=False, shape=t.shape, stride=t.stride())  # fmt: skip
    tenplex.load(target, job="strided")
    for n, t in fulls.items():
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, flat, [Shard(0)])
        index = tuple(slice(o, o + k) for o, k in zip(offset, local_shape))
        if not torch.equal(target[n].to_local(), t[index]):
            out["bad"].append(f"{n} into Shard(0)")
    tenplex.save(target, job="strided", step=2)
    back = {n: strided(n, torch.zeros_like(t)) for n, t in fulls.items()}
    tenplex.load(back, job="strided", step=2)
    for n, t in fulls.items():
        if not torch.equal(back[n].to_local(), strided(n, t).to_local()):
            out["bad"].append(f"{n} back into the strided layout")
        if not torch.equal(back[n].full_tensor(), t):  # torch itself reassembles the loaded shards
            out["bad"].append(f"{n}: full_tensor differs")
    one = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("x",))
    interleaved = distribute_tensor(
        fulls["even"], one, [_StridedShard(0, split_factor=2)], src_data_rank=None
    )
    try:
        tenplex.save({"w": interleaved}, job="interleaved", step=1)
        out["interleaved"] = "no error"
    except tenplex.TenplexError as e:
        out["interleaved"] = str(e)
    dist.barrier()
    return out


def run_gather(groups: dict[int, object], rank: int) -> dict:
    """`world.all_gather` against torch's `all_gather_object`: objects that fit a slot, one that does not
    (a second round), each rank's of another size, in the whole world and in the group of ranks 0-2."""
    from tenplex.transformer import world

    objects = [None, ("r", rank), {"rows": list(range(rank * 9000))}, b"x" * (world.SLOT if rank == 1 else 3)]
    out = {"world": [], "group": [], "then": [], "broadcast": [], "raised": ""}
    for obj in objects:
        want: list = [None] * dist.get_world_size()
        dist.all_gather_object(want, obj)
        out["world"].append(world.all_gather(obj) == want)
        if rank < 3:
            out["group"].append(world.all_gather((rank, obj), groups[3]) == list(enumerate(want[:3])))
        # rank 0 gets every rank's object (a second gather for one beyond the slot) and answers all
        out["then"].append(world.gather_then(obj, lambda got: (got, len(got))) == (want, len(want)))
        sent = (want[0], list(range(40)))  # beyond a 64-byte slot: a second round
        out["broadcast"].append(world.broadcast(sent if rank == 0 else "not rank 0's", slot=64) == sent)
    try:
        world.gather_then(rank, lambda got: 1 / (sum(got) - sum(got)))
    except ZeroDivisionError as e:
        out["raised"] = str(e)
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {k: dist.new_group(list(range(k))) for k in (1, 2, 3, 4)}
    write_result(
        {
            "pairs": run_pairs(groups, rank),
            "errors": run_errors(groups, rank),
            "foreign": run_foreign_module(groups, rank),
            "modes": run_modes(groups, rank),
            "strided": run_strided(rank),
            "gather": run_gather(groups, rank),
        }
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
