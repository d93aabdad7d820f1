"""The state benchmarks/bench_peers.py moves: the reference GPT's parameters and AdamW moments as DTensors in
an FSDP2 / HSDP / DDP layout, plus the optimizer's plain values, with known values checked bit for bit.

Imports only torch and tenplex.ptc (no torch integration), so the ByteCheckpoint worker can build the same
state under its own, older torch (2.5) in a venv of its own.
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.device_mesh import DeviceMesh

try:  # torch >= 2.5 has the public module; the names are the same
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor, Replicate, Shard
    from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

from tenplex.ptc.gpt import GPTConfig, param_shapes

KINDS = ("param", "exp_avg", "exp_avg_sq")
STEP = 100.0
PARAM_GROUP = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def layout(replicas: int, shards: int, first: int = 0) -> list[list[int]]:
    """The ranks of a (replicate, shard) mesh from rank `first`: FSDP2 is (1, n), DDP (n, 1), HSDP (r, s)."""
    return [[first + r * shards + s for s in range(shards)] for r in range(replicas)]


def expected(fqn: str, kind: str, shape: tuple, offset: tuple, local: tuple) -> torch.Tensor:
    """The global tensor's values at one box: its flat element index plus a salt per tensor and kind, exact in
    fp32 (below 2**24), so every rank computes the same value for the same global element."""
    salt = float(zlib.crc32(f"{fqn}/{kind}".encode()) % 1000)
    if not local:
        return torch.tensor(salt)
    index = torch.zeros(local, dtype=torch.float64)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = local[dim]
        index += torch.arange(offset[dim], offset[dim] + local[dim], dtype=torch.float64).view(view) * stride
        stride *= shape[dim]
    return (index + salt).to(torch.float32)


def build(cfg: GPTConfig, ranks: list[list[int]], rank: int, zeros: bool) -> dict:
    """This rank's state dict on the (replicate, shard) mesh `ranks`: every tensor Shard(0) over the shard dim
    (FSDP2's layout), replicated over the other. Meshes are made without communicators: only the systems under
    test communicate."""
    mesh = DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("replicate", "shard"), _init_backend=False)
    pl = [Replicate(), Shard(0)]
    model, state = {}, {}
    for fqn, shape, _, _ in param_shapes(cfg):
        local, offset = compute_local_shape_and_global_offset(shape, mesh, pl)
        stride = torch.empty(shape, device="meta").stride()
        made = {}
        for kind in KINDS:
            t = torch.zeros(local) if zeros else expected(fqn, kind, shape, tuple(offset), tuple(local))
            made[kind] = DTensor.from_local(
                t, mesh, pl, run_check=False, shape=torch.Size(shape), stride=stride
            )
        model[fqn] = made["param"]
        state[fqn] = {"step": torch.tensor(0.0 if zeros else STEP), **{k: made[k] for k in KINDS[1:]}}
    return {"model": model, "optim": {"state": state, "param_groups": [dict(PARAM_GROUP)]}}


def tensors(sd: dict) -> list[DTensor]:
    out = list(sd["model"].values())
    for st in sd["optim"]["state"].values():
        out += [st["exp_avg"], st["exp_avg_sq"]]
    return out


def zero(sd: dict) -> None:
    for t in tensors(sd):
        t.to_local().zero_()
    for st in sd["optim"]["state"].values():
        st["step"].zero_()


def local_bytes(sd: dict) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in tensors(sd))


def check(sd: dict) -> list[str]:
    """Up to five names whose local shard (or step) differs from the values the source was built from."""
    bad = []
    for fqn, param in sd["model"].items():
        st = sd["optim"]["state"][fqn]
        for kind, t in zip(KINDS, (param, st["exp_avg"], st["exp_avg_sq"])):
            local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            want = expected(fqn, kind, tuple(t.shape), tuple(offset), tuple(local))
            if not torch.equal(t.to_local(), want):
                bad.append(f"{fqn}.{kind}")
        if float(st["step"]) != STEP:
            bad.append(f"{fqn}.step={float(st['step'])}")
    return bad[:5]


def copy_into(dst: dict, got: dict) -> None:
    """What a model's and an optimizer's load_state_dict do with a received state: copy it into the tensors
    the job already has (the receiving rank holds the bytes in its own tensors)."""
    for fqn, t in dst["model"].items():
        _local(t).copy_(_local(got["model"][fqn]))
    for fqn, st in dst["optim"]["state"].items():
        for k in ("step", *KINDS[1:]):
            _local(st[k]).copy_(_local(got["optim"]["state"][fqn][k]))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
