"""A user's own model as a list of tensors, and its symbolic PTC for any (dp, tp, pp): no torch, no I/O.

A description says, per parameter, its shape, dtype, the dim tensor parallelism splits (if any) and the
layer that places it on a pipeline stage; with it `tenplex plan` and `tenplex choose` work on any model,
not only the GPT presets. The format (JSON or YAML on disk) is documented in docs/cli.md:

    {"format": "tenplex.model", "heads": 4, "hidden": 64, "seq": 64, "optimizer": "adamw",
     "tensors": [{"name": "emb.weight", "shape": [256, 64], "tp_dim": 0, "layer": "first"},
                 {"name": "blocks.0.fc.weight", "shape": [256, 64], "tp_dim": 0, "layer": 0}, ...]}

A PTC (a snapshot's, from a store) gives one too: shapes and dtypes exactly, each tensor's layer read from
its name, but no tensor-parallel split, which a snapshot's pieces do not record.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from .collection import PTC, TensorMeta
from .errors import PTCError
from .layout import check_layout
from .mesh import Mesh
from .placement import Placement

FORMAT = "tenplex.model"
ENDS = ("first", "last")  # the pipeline's first and last stage (embeddings, final norm, head)
ADAMW = ("exp_avg", "exp_avg_sq")
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


class ModelError(PTCError):
    """A model description that cannot be read, or a layout it cannot take."""


@dataclass(frozen=True)
class Param:
    """One tensor: `where` lists the layers (block numbers) or ends that own it; empty: every stage."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    tp_dim: int | None = None
    where: tuple[int | str, ...] = ()

    def stages(self, layers: int, pp: int) -> tuple[int, ...] | None:
        if not self.where:
            return None
        return tuple(sorted({_stage(w, layers, pp) for w in self.where}))


@dataclass(frozen=True)
class ModelSpec:
    """A model's tensors, and what the layout rules and the chooser's cost model ask of a GPTConfig."""

    params: tuple[Param, ...]
    layers: int
    heads: int  # tp must divide it
    hidden: int = 0  # 0: unknown (the cost model then leaves activations out)
    seq: int = 0
    optimizer: bool = True  # AdamW state beside every parameter, named as torch's state dict does
    tp_known: bool = True  # False for a snapshot: its pieces do not say how tensors split over tp
    tied: bool = False  # (GPTConfig's: the reference workload's rule, never for a user's model)

    def param_count(self) -> int:
        """Parameters only: a PTC's own optimizer state (`optim.*`) is not counted."""
        return sum(prod(p.shape) for p in self.params if self.optimizer or not p.name.startswith("optim."))

    def check(self, dp: int, tp: int, pp: int) -> None:
        if tp > 1 and not self.tp_known:
            raise ModelError(
                f"tp={tp}: a snapshot does not say how its tensors split over tp; "
                "describe the model in a file (--model FILE) to plan or rank tensor parallelism"
            )
        check_layout(self, dp, tp, pp)

    def to_json(self) -> dict[str, Any]:
        """The description file of this model (`from_json` reads it back)."""
        tensors = [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "tp_dim": p.tp_dim,
                    "layer": list(p.where) if len(p.where) > 1 else p.where[0] if p.where else "all"}
                   for p in self.params]  # fmt: skip
        sizes = {"layers": self.layers, "heads": self.heads, "hidden": self.hidden, "seq": self.seq}
        return {
            "format": FORMAT,
            **sizes,
            "optimizer": "adamw" if self.optimizer else "none",
            "tensors": tensors,
        }

    @classmethod
    def from_json(cls, data: Any) -> ModelSpec:
        """A description (a dict, or just its list of tensors); every problem one line."""
        if isinstance(data, list):
            data = {"tensors": data}
        if not isinstance(data, dict) or not isinstance(data.get("tensors"), list) or not data["tensors"]:
            raise ModelError('a model description is {"tensors": [{"name", "shape", ...}, ...], ...}')
        if data.get("format", FORMAT) != FORMAT:
            raise ModelError(f"format {data['format']!r} is not {FORMAT!r}")
        unknown = set(data) - {"format", "tensors", "layers", "heads", "hidden", "seq", "optimizer"}
        if unknown:
            raise ModelError(f"unknown keys in the model description: {', '.join(sorted(unknown))}")
        params = tuple(_param(i, t) for i, t in enumerate(data["tensors"]))
        numbered = [w for p in params for w in p.where if isinstance(w, int)]
        layers = _count(data, "layers", max(numbered, default=-1) + 1 or 1)
        split = any(p.tp_dim is not None for p in params)
        if split and "heads" not in data:
            raise ModelError("tensors split over tp (tp_dim) need `heads`: how many ways tp may split them")
        if max(numbered, default=0) >= layers:
            raise ModelError(f"a tensor names layer {max(numbered)}, but the model has {layers} layers")
        optimizer = data.get("optimizer", "adamw")
        if optimizer not in ("adamw", "none", None):
            raise ModelError(f"optimizer {optimizer!r}: adamw or none")
        return cls(params, layers, _count(data, "heads", 1), _count(data, "hidden", 0),
                   _count(data, "seq", 0), optimizer == "adamw")  # fmt: skip

    @classmethod
    def from_ptc(cls, ptc: PTC) -> ModelSpec:
        """A PTC's tensors as they are named (optimizer state included), each placed by the first number in
        its name (`blocks.3.` -> layer 3); those without one on the first stage when they come before the
        numbered tensors of their kind (`model.`, `optim.`), else on the last."""
        numbered: dict[str, int | None] = {n: _number(n) for n in ptc.tensors}
        seen: set[str] = set()
        params = []
        for name, meta in ptc.tensors.items():
            kind = name.split(".", 1)[0]
            layer = numbered[name]
            if layer is not None:
                seen.add(kind)
            where: int | str = layer if layer is not None else ENDS[kind in seen]
            params.append(Param(name, meta.shape, meta.dtype, None, (where,)))
        layers = max((n for n in numbered.values() if n is not None), default=0) + 1
        return cls(tuple(params), layers, 1, optimizer=False, tp_known=False)


def model_ptc(
    spec: ModelSpec,
    dp: int,
    tp: int,
    pp: int,
    *,
    devices_per_host: int = 8,
    devices: Sequence[tuple[str, str]] | None = None,
    zero: int = 0,
    optimizer: bool | None = None,
) -> PTC:
    """The PTC of `spec` on a (pp, dp, tp) mesh (tp fastest, so tp groups share hosts).

    zero=1 shards the AdamW moments over dp (ZeRO-1); zero=3 shards parameters too (FSDP / ZeRO-3). Sharding
    over dp splits dim 0, in mesh order before tp.
    """
    spec.check(dp, tp, pp)
    if zero not in (0, 1, 2, 3):
        raise PTCError(f"zero must be 0, 1, 2 or 3, got {zero}")
    adamw = spec.optimizer if optimizer is None else optimizer
    mesh = Mesh.build((("pp", pp), ("dp", dp), ("tp", tp)), devices_per_host, devices)
    entries = []
    for p in spec.params:
        stages = p.stages(spec.layers, pp)
        shards = {} if p.tp_dim is None else {"tp": p.tp_dim}
        place = Placement.of(stages, **shards)
        sharded = Placement.of(stages, **{"dp": 0, **shards}) if p.shape else place
        name = f"model.{p.name}" if spec.optimizer else p.name
        entries.append((TensorMeta(name, p.shape, p.dtype), sharded if zero >= 3 else place))
        if adamw:
            moments = sharded if zero >= 1 else place
            for key in ADAMW:
                entries.append((TensorMeta(f"optim.state.{p.name}.{key}", p.shape, "float32"), moments))
            entries.append((TensorMeta(f"optim.state.{p.name}.step", (), "float32"), Placement.of(stages)))
    return PTC.build(mesh, entries, {"step": 0})


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """The transformer blocks of pipeline stage `stage`: contiguous, as even as possible."""
    return range(stage * layers // pp, (stage + 1) * layers // pp)


def stage_of_layer(layers: int, pp: int, layer: int) -> int:
    return next(s for s in range(pp) if layer in stage_layers(layers, pp, s))


def _stage(where: int | str, layers: int, pp: int) -> int:
    if where == "first":
        return 0
    if where == "last":
        return pp - 1
    return stage_of_layer(layers, pp, int(where))


def _number(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _count(data: dict, key: str, default: int) -> int:
    v = data.get(key, default)
    if type(v) is not int or v < (1 if key in ("layers", "heads") else 0):
        raise ModelError(
            f"`{key}` must be a {'positive' if key in ('layers', 'heads') else 'whole'} number, got {v!r}"
        )
    return v


def _param(i: int, t: Any) -> Param:
    if not isinstance(t, dict) or "name" not in t or "shape" not in t:
        raise ModelError(f"tensor #{i} needs a name and a shape, got {t!r}")
    what = f"tensor {t['name']!r}"
    unknown = set(t) - {"name", "shape", "dtype", "tp_dim", "layer"}
    if unknown:
        raise ModelError(
            f"{what}: unknown keys {', '.join(sorted(unknown))} (name, shape, dtype, tp_dim, layer)"
        )
    shape = t["shape"]
    if not isinstance(shape, list) or any(type(s) is not int or s < 0 for s in shape):
        raise ModelError(f"{what}: shape must be a list of sizes, got {shape!r}")
    tp_dim = t.get("tp_dim")
    if tp_dim is not None and (type(tp_dim) is not int or not 0 <= tp_dim < len(shape)):
        raise ModelError(f"{what}: tp_dim {tp_dim!r} is not one of its {len(shape)} dims")
    layer = t.get("layer", "all")
    where = tuple(layer) if isinstance(layer, list) else (layer,)
    if where == ("all",):
        where = ()
    for w in where:
        if not (w in ENDS or (type(w) is int and w >= 0)):
            raise ModelError(f"{what}: layer {w!r} is not a layer number, first, last or all")
    try:
        meta = TensorMeta(str(t["name"]), tuple(shape), str(t.get("dtype", "float32")))
    except PTCError as e:
        raise ModelError(f"{what}: {e}") from None
    return Param(meta.name, meta.shape, meta.dtype, tp_dim, where)
