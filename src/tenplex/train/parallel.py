"""(dp, tp, pp) layouts of the GPT on a DeviceMesh with axes ("pp", "dp", "tp"), tp fastest.

Everything here is PyTorch's own stack: DTensor tensor parallelism through `parallelize_module`, pipeline
stages for `torch.distributed.pipelining` made by deleting what a stage does not own from the full model,
DDP-style gradient all-reduce over dp, or FSDP2 `fully_shard` over dp. Every rank first builds the *full*
model from the seed and only then cuts it, so the global parameters are identical in every layout.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..ptc import GPTConfig
from ..ptc.layout import Layout
from .model import GPT

AXES = ("pp", "dp", "tp")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_mesh(layout: Layout, device: str | None = None) -> DeviceMesh:
    """The job's 3-D mesh; rank = (pp * dp_size + dp) * tp_size + tp."""
    return init_device_mesh(device or device_type(), (layout.pp, layout.dp, layout.tp), mesh_dim_names=AXES)


def coords(mesh: DeviceMesh) -> tuple[int, int, int]:
    """This rank's (pp, dp, tp) coordinates."""
    return tuple(mesh.get_local_rank(a) for a in AXES)  # type: ignore[return-value]


def tp_plan(model: GPT) -> dict[str, object]:
    """Megatron-style plan: column-parallel qkv/fc1 (heads split), row-parallel proj/fc2, vocab-parallel
    embedding and head (the logits are gathered, so the loss is the ordinary cross-entropy)."""
    plan: dict[str, object] = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
    for key in model.blocks:
        plan[f"blocks.{key}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{key}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{key}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{key}.mlp.fc2"] = RowwiseParallel()
    if model.head is not None:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def build_model(
    cfg: GPTConfig, layout: Layout, mesh: DeviceMesh, seed: int, device: torch.device | None = None
) -> GPT:
    """The full model from `seed`, cut to this rank's pipeline stage, tp-sharded, and FSDP-wrapped."""
    layout.check(cfg, mesh.size())
    stage, _, _ = coords(mesh)
    device = device or torch.device(mesh.device_type)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(cfg)
    model.keep_stage(layout.pp, stage).to(device)
    if layout.tp > 1:
        parallelize_module(model, mesh["tp"], tp_plan(model))
    if layout.fsdp:
        from torch.distributed.fsdp import fully_shard

        # the logits come out of a 3-D linear, a view; nothing modifies them in place, so FSDP's warning
        # about in-place ops on views does not apply
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        dp_mesh = mesh["dp"]
        for block in model.blocks.values():
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        # the loss is already divided by the global token count: reduce-scatter must sum, not average
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def forget_meshes() -> None:
    """Empty DTensor's caches before a process trains in a new process group. They are keyed on meshes,
    and a mesh equals any later one of the same ranks, shape and names, whatever its groups: a process
    that trained a layout, saw its groups destroyed and trains the same layout again would get outputs on
    the old mesh, whose groups are gone (a crash: "Could not resolve the process group") or, were the
    names handed out again, belong to another world. Costs the next first step its cache misses."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def allreduce_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """DDP-style: sum every gradient over the dp group, one flat buffer per dtype."""
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in gs:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sq_norm_share(model: nn.Module, layout: Layout) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (float64), such that summing the shares over
    the whole world gives the norm once: a piece held by k ranks contributes 1/k on each of them."""
    holders = layout.dp * layout.tp  # the ranks of one pipeline stage
    shares = []
    for p in model.parameters():
        if p.grad is None:
            continue
        pieces = 1
        if isinstance(p.grad, DTensor):
            for size, place in zip(p.grad.device_mesh.shape, p.grad.placements):
                if not (place.is_replicate() or place.is_partial()):  # Shard, _StridedShard (FSDP+tp)
                    pieces *= size
        shares.append(local(p.grad).detach().double().pow(2).sum() * (pieces / holders))
    # one device-to-host copy, not one per parameter
    return torch.stack(shares).sum().cpu() if shares else torch.zeros((), dtype=torch.float64)


def scale_grads(model: nn.Module, factor: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                local(p.grad).mul_(factor)
