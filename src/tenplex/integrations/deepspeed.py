"""DeepSpeed ZeRO engines elastic: an engine's training state as tenplex tensors, for any dp size and stage.

ZeRO keeps each rank's share of the fp32 master weights and of the optimizer moments in flat partitions:
stages 1 and 2 cut one flat buffer per parameter group (its parameters concatenated and padded) into equal
parts, stage 3 cuts every parameter into equal parts, stage 0 keeps every parameter whole. Whatever the
stage, a rank holds one contiguous range of each flattened parameter. `DeepSpeedState` names those ranges
as 1-D pieces of the flattened parameters (`master.<param>`, `optim.<key>.<param>`), so that a snapshot
written under any stage and dp size loads into any other: each new rank pulls exactly its new ranges,
straight into DeepSpeed's own buffers. The model's weights are not stored: they are the master weights
(in the model's dtype), refreshed from them after a load as DeepSpeed does after a step; their shapes are
(values), for an export to DeepSpeed's own checkpoint format (deepspeed_export).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..ptc import TenplexError
from ..transformer.shards import piece

COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
HYPER = (int, float, bool, str, tuple, list, type(None))  # param-group settings a snapshot carries


class DeepSpeedStateError(TenplexError):
    """An engine whose state this adapter does not map (an optimizer wrapper or setting it does not know)."""


@dataclass(frozen=True)
class Fragment:
    """This rank's range [start, start + len(hp)) of one flattened parameter, where it lies in ZeRO's flat
    partition `flat` (which keys the optimizer's state) and which of the user's param groups it is in."""

    name: str
    numel: int
    start: int
    hp: torch.Tensor  # a view into `flat`
    flat: torch.Tensor
    offset: int
    group: int


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _zero12(opt: Any, names: dict[int, str]) -> list[Fragment]:
    """Stages 1 and 2: DeepSpeed's own map of each parameter onto the fp32 partition (`_hp_mapping`, what
    its universal checkpoints use); None where this rank holds nothing of the parameter."""
    out = []
    for i, params in enumerate(opt.bit16_groups):
        flat = opt.single_partition_of_fp32_groups[i]
        for p in params:
            m = p._hp_mapping
            start, n, at = (m.lp_fragment_address.start, m.lp_fragment_address.numel,
                            m.hp_fragment_address.start) if m is not None else (0, 0, 0)  # fmt: skip
            out.append(Fragment(names[id(p)], p.numel(), start, flat.narrow(0, at, n), flat, at, i))
    return out


def _zero3(opt: Any, names: dict[int, str]) -> list[Fragment]:
    """Stage 3: every parameter cut into equal parts (the last one padded), rank r holding part r."""
    out = []
    for i, params in enumerate(opt.fp16_groups):
        flat = opt.fp32_partitioned_groups_flat[i]
        for p in params:
            _, at, n = opt.grad_position[opt.get_param_id(p)]
            start = min(n * opt._get_param_partition_rank(p), p.ds_numel)
            n = max(0, min(n, p.ds_numel - start))
            group = opt.sub_group_to_group_id[i]
            out.append(Fragment(names[id(p)], p.ds_numel, start, flat.narrow(0, at, n), flat, at, group))
    return out


def _zero0(opt: torch.optim.Optimizer, names: dict[int, str]) -> list[Fragment]:
    """No ZeRO (fp32): the parameters are the master weights, whole on every rank."""
    return [
        Fragment(names[id(p)], p.numel(), 0, p.data.view(-1), p, 0, g)
        for g, group in enumerate(opt.param_groups)
        for p in group["params"]
    ]


def fragments(engine: Any) -> list[Fragment]:
    """This rank's fragments of every trained parameter of `engine`, in DeepSpeed's own order."""
    stage, opt = engine.zero_optimization_stage(), engine.optimizer
    kind = type(opt).__name__
    if any(not p.requires_grad for p in engine.module.parameters()):
        raise DeepSpeedStateError("frozen parameters are not carried: train them all, or leave them out")
    if getattr(engine, "fp16_enabled", lambda: False)():
        raise DeepSpeedStateError("fp16 training's loss scaler state is not carried: use fp32 or bf16")
    if getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False):
        raise DeepSpeedStateError("ZeRO with the optimizer offloaded is not mapped (offload_optimizer)")
    names = _names(engine.module)
    if stage in (1, 2) and kind == "DeepSpeedZeroOptimizer":
        return _zero12(opt, names)
    if stage == 3 and kind == "DeepSpeedZeroOptimizer_Stage3":
        return _zero3(opt, names)
    if stage == 0 and isinstance(opt, torch.optim.Optimizer):
        return _zero0(opt, names)
    raise DeepSpeedStateError(f"ZeRO stage {stage} with {kind} is not mapped (stages 0-3, fp32 or bf16)")


def base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The user's torch optimizer inside the engine (ZeRO wraps it; stage 0 uses it as is)."""
    return engine.optimizer if engine.zero_optimization_stage() == 0 else engine.optimizer.optimizer


def _flats(frags: list[Fragment]) -> dict[int, list[torch.Tensor]]:
    """The flat partitions of each of the user's param groups, once each, in order."""
    out: dict[int, dict[int, torch.Tensor]] = {}
    for f in frags:
        out.setdefault(f.group, {})[id(f.flat)] = f.flat
    return {g: list(per.values()) for g, per in out.items()}


def _create_state(opt: torch.optim.Optimizer, frags: list[Fragment]) -> None:
    """As DCP's state-dict API does for a fresh optimizer: one step with zero gradients at learning rate 0
    gives it its state (tensors for a load to fill) and leaves the weights as they are. Run on ZeRO's flat
    partitions, which are what its optimizer steps (stage 3 hands them to the groups one at a time)."""
    flats = _flats(frags)
    kept = [(group["params"], group["lr"]) for group in opt.param_groups]
    grads = {id(t): t.grad for per in flats.values() for t in per}
    try:
        for g, group in enumerate(opt.param_groups):
            group["params"], group["lr"] = flats.get(g, []), 0.0
            for t in group["params"]:
                t.grad = torch.zeros_like(t)
        opt.step()
    finally:
        for group, (params, lr) in zip(opt.param_groups, kept):
            for t in group["params"]:
                t.grad = grads[id(t)]
            group["params"], group["lr"] = params, lr


def _partitioned(opt: torch.optim.Optimizer, frags: list[Fragment]) -> list[str]:
    """The optimizer's state entries shaped like the partition (Adam's moments); the rest (its step) is
    one value per param group."""
    state = opt.state[frags[0].flat] if frags else {}
    return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == frags[0].flat.shape]


def _groups(opt: torch.optim.Optimizer, frags: list[Fragment], partitioned: list[str]) -> dict[int, Any]:
    """Per param group: its settings (lr, betas, ...) and its state's values (the step)."""
    out = {}
    for g, flats in _flats(frags).items():
        state = opt.state[flats[0]]
        scalars = {k: v.item() if torch.is_tensor(v) else v for k, v in state.items() if k not in partitioned}
        settings = {k: v for k, v in opt.param_groups[g].items() if k != "params" and isinstance(v, HYPER)}
        out[g] = {"settings": settings, "state": scalars}
    return out


def _set_groups(opt: torch.optim.Optimizer, frags: list[Fragment], groups: dict[int, Any]) -> None:
    for g, flats in _flats(frags).items():
        group = opt.param_groups[g]
        for k, v in groups[g]["settings"].items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v  # a manifest holds lists
        for flat in flats:
            state = opt.state[flat]
            for k, v in groups[g]["state"].items():
                old = state.get(k)
                state[k] = torch.tensor(v, dtype=old.dtype, device=old.device) if torch.is_tensor(old) else v


def _refresh_model(engine: Any) -> None:
    """The model's weights from the loaded master weights, as DeepSpeed makes them after a step."""
    stage, opt = engine.zero_optimization_stage(), engine.optimizer
    if stage in (1, 2):
        opt.update_lp_params()  # each rank's partition into the model's flat buffer, then all-gathered
        opt._lazy_init_hp_params_optimizer_state()  # DeepSpeed's own views of the moments (its first step's)
    elif stage == 3:
        opt.checkpoint_event_prologue()  # gathered parameters released: each holds its partition only
        for i in range(len(opt.fp16_partitioned_groups_flat)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
        opt.checkpoint_event_epilogue()  # the persistent (small, never partitioned) ones gathered again


class DeepSpeedState:
    """What a DeepSpeed script hands to `ElasticJob` (`job.resume(DeepSpeedState(engine, sampler=s))`): the
    engine's master weights and optimizer state as pieces of flattened parameters, the param groups'
    settings and step, the module's buffers, the engine's counters, its LR scheduler, and any stateful
    `extra` (the sampler). `restore` hands a loaded state back; `start_fresh` undoes what building the
    first state did (the optimizer's state, created for a load to fill)."""

    def __init__(self, engine: Any, **extra: Any) -> None:
        self.engine, self.extra = engine, extra
        self._created_optimizer_state = False

    def __call__(self) -> dict[str, Any]:
        frags, opt = fragments(self.engine), base_optimizer(self.engine)
        if not opt.state:
            _create_state(opt, frags)
            self._created_optimizer_state = True
        keys = _partitioned(opt, frags)
        scheduler = self.engine.lr_scheduler
        return {
            "master": {f.name: piece(f.hp, (f.numel,), (f.start,)) for f in frags},
            "optim": {k: {f.name: _piece(opt.state[f.flat][k], f) for f in frags} for k in keys},
            "groups": _groups(opt, frags, keys),
            "shapes": shapes(self.engine.module),
            "buffers": dict(self.engine.module.named_buffers()),
            "engine": {c: getattr(self.engine, c) for c in COUNTERS},
            **({"scheduler": scheduler} if scheduler is not None else {}),
            **self.extra,
        }

    def start_fresh(self) -> None:
        if self._created_optimizer_state:
            base_optimizer(self.engine).state.clear()
            self._created_optimizer_state = False

    def restore(self, state: dict[str, Any]) -> None:
        """The loaded values into the optimizer and the engine (the tensors were loaded in place), and the
        model's weights from the master weights."""
        _set_groups(base_optimizer(self.engine), fragments(self.engine), state["groups"])
        for c in COUNTERS:
            setattr(self.engine, c, state["engine"][c])
        _refresh_model(self.engine)


def shapes(module: nn.Module) -> dict[str, list[int]]:
    """Each parameter's shape (ZeRO-3 keeps it in `ds_shape`): the pieces are of flattened parameters, and
    an export to DeepSpeed's universal checkpoint writes them whole, in their own shapes."""
    return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}


def _piece(t: torch.Tensor, f: Fragment) -> torch.Tensor:
    return piece(t.view(-1).narrow(0, f.offset, f.hp.numel()), (f.numel,), (f.start,))


def zero_stage(world: int, table: str, default: int) -> int:
    """The ZeRO stage for `world` ranks from a script's `--stages` table ("3:3,1:0": stage 3 on 3 ranks,
    none on 1; any other world size runs `default`)."""
    stages = {}
    for entry in filter(None, table.split(",")):
        n, _, s = entry.partition(":")
        try:
            stages[int(n)] = int(s)
        except ValueError:
            raise TenplexError(f"--stages {table!r}: expected WORLD:STAGE entries such as 3:3") from None
    stage = stages.get(world, default)
    if stage not in (0, 1, 2, 3):
        raise TenplexError(f"ZeRO stage {stage}: expected 0, 1, 2 or 3")
    return stage
