"""Choosing (dp, tp, pp) for N devices: every valid layout, a calibrated step-time estimate, the best one.

The cost model has one term per effect a layout changes: compute spread over the ranks that can run at
once (with the pipeline bubble), tensor-parallel activation all-reduces (their bytes and their count),
data-parallel gradient
all-reduces, pipeline sends, and a per-process overhead. Its coefficients are fitted (non-negative least
squares) to the reference workload's benchmark (`benchmarks/bench_train.py`), so they reflect the machine
the benchmark ran on. A user table (the paper's para-config: devices -> layout) overrides the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np
from scipy.optimize import nnls

from ..ptc import GPTConfig, ModelSpec, PTCError, preset
from ..ptc.layout import Layout, layouts
from ..util import env
from .tables import read_table

FEATURES = ("constant", "compute", "tp_comm", "tp_calls", "dp_comm", "pp_comm", "processes")


class ChooserError(PTCError):
    """No layout fits, or a malformed para-config table."""


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    seconds: float
    memory: int  # bytes per device

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "dp": lay.dp,
            "tp": lay.tp,
            "pp": lay.pp,
            "step_seconds": self.seconds,
            "memory_bytes": self.memory,
        }


def features(
    cfg: GPTConfig | ModelSpec, lay: Layout, global_batch: int, micro_batch: int, cores: int
) -> np.ndarray:
    n = lay.world
    params = cfg.param_count()
    tokens = global_batch * cfg.seq
    per_rank = global_batch / lay.dp
    micro = max(1, int(-(-per_rank // max(1, micro_batch))))
    bubble = (micro + lay.pp - 1) / micro
    act = per_rank * cfg.seq * cfg.hidden  # activation elements of one layer on one dp rank
    return np.array(
        [
            1.0,
            6.0 * params * tokens / min(n, cores) * bubble / 1e9,
            (lay.tp > 1) * cfg.layers / lay.pp * act * 4 * 2 * (lay.tp - 1) / lay.tp / 1e6,
            (lay.tp > 1) * cfg.layers / lay.pp * micro * lay.tp,  # collectives: latency-bound when small
            (lay.dp > 1) * params / (lay.tp * lay.pp) * 2 * (lay.dp - 1) / lay.dp / 1e6,
            (lay.pp > 1) * act * 2 * micro / 1e6,
            n / cores,
        ]
    )


def memory_per_device(cfg: GPTConfig | ModelSpec, lay: Layout, global_batch: int, micro_batch: int) -> int:
    """fp32 parameters, gradients and AdamW moments (16 B a parameter) plus one micro-batch's activations."""
    state = 16 * cfg.param_count() / (lay.tp * lay.pp) / (lay.dp if lay.fsdp else 1)
    micro = micro_batch or max(1, global_batch // lay.dp)
    acts = 34 * micro * cfg.seq * cfg.hidden * cfg.layers / lay.pp / lay.tp * 2  # Megatron's 34sbh, in fp32
    return int(state + acts)


@dataclass
class CostModel:
    coefficients: np.ndarray
    cores: int

    def seconds(self, cfg: GPTConfig | ModelSpec, lay: Layout, global_batch: int, micro_batch: int) -> float:
        return float(features(cfg, lay, global_batch, micro_batch, self.cores) @ self.coefficients)

    @classmethod
    def fit(cls, rows: list[dict], cores: int) -> CostModel:
        X = np.array(
            [
                features(
                    preset(r["model"]),
                    Layout(r["dp"], r["tp"], r["pp"], r.get("fsdp", False)),
                    r["global_batch"],
                    r.get("micro_batch", 0),
                    cores,
                )
                for r in rows
            ]
        )
        y = np.array([r["step_time_s"] for r in rows])
        return cls(nnls(X / y[:, None], np.ones(len(y)))[0], cores)  # relative error: each row counts alike


@cache
def calibration() -> dict:
    """The benchmark rows the model is fitted to: $TENPLEX_CALIBRATION, else the packaged measurement."""
    path = env.get(env.CALIBRATION)
    if path:
        return read_table(path, "calibration", ChooserError)
    return json.loads(resources.files(__package__).joinpath("calibration.json").read_text())


def calibration_rows(data: dict) -> list[dict]:
    """Rows of `benchmarks/bench_train.py` outputs ({"runs": [{"meta", "rows"}, ...]}) with their model
    and batch."""
    out = []
    for run in data["runs"]:
        meta = run["meta"]
        keep = {
            "model": meta["model"],
            "global_batch": meta["global_batch"],
            "micro_batch": meta["micro_batch"],
        }
        out += [{**keep, **row} for row in run["rows"]]
    return out


def self_check(rows: list[dict], cores: int) -> list[dict]:
    """Per (model, devices) of the calibration benchmark, judged leave-one-out: the cost model is fitted to
    every other group's rows, picks a layout for this one, and the pick's measured step time is set
    against the best measured one (1.0: the model picked the fastest). A model judged on the rows it was
    fitted on would look better than it predicts."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["world"]), []).append(r)
    out = []
    for (name, world), rs in groups.items():
        model = CostModel.fit([r for r in rows if (r["model"], r["world"]) != (name, world)], cores)
        pick = min(
            rs,
            key=lambda r: model.seconds(
                preset(r["model"]),
                Layout(r["dp"], r["tp"], r["pp"], r.get("fsdp", False)),
                r["global_batch"],
                r["micro_batch"],
            ),
        )
        best = min(r["step_time_s"] for r in rs)
        out.append(
            {"model": name, "devices": world, "pick": pick["layout"], "ratio": pick["step_time_s"] / best}
        )
    return out


@cache
def default_model() -> CostModel:
    data = calibration()
    return CostModel.fit(calibration_rows(data), data["cores"])


def candidates(
    cfg: GPTConfig | ModelSpec,
    devices: int,
    global_batch: int,
    micro_batch: int = 0,
    device_memory: int | None = None,
) -> list[Layout]:
    """Layouts the architecture, the batch and the memory allow (heads % tp, layers % pp, batch % dp)."""
    return [
        lay
        for lay in layouts(cfg, devices, reference=False, global_batch=global_batch, even_stages=True)
        if device_memory is None or memory_per_device(cfg, lay, global_batch, micro_batch) <= device_memory
    ]


def rank_layouts(
    model: str | ModelSpec,
    devices: int,
    global_batch: int,
    micro_batch: int = 0,
    device_memory: int | None = None,
    cost: CostModel | None = None,
) -> list[Estimate]:
    cfg = preset(model) if isinstance(model, str) else model  # a ModelSpec has what the cost model asks
    cost = cost or default_model()
    out = [
        Estimate(
            lay,
            cost.seconds(cfg, lay, global_batch, micro_batch),
            memory_per_device(cfg, lay, global_batch, micro_batch),
        )
        for lay in candidates(cfg, devices, global_batch, micro_batch, device_memory)
    ]
    return sorted(out, key=lambda e: (e.seconds, e.layout.tp, e.layout.pp))


def parse_table(data: Any) -> dict[int, Layout]:
    """The paper's para-config: {"<devices>": {"dp": D, "tp": T, "pp": P}} (mp_size/dp_size/pp_size too)."""
    if not isinstance(data, dict):
        raise ChooserError("a para-config table maps device counts to {dp, tp, pp}")
    out = {}
    for key, v in data.items():
        try:
            n = int(key)
            dp = int(v.get("dp", v.get("dp_size", 1)))
            tp = int(v.get("tp", v.get("mp_size", 1)))
            pp = int(v.get("pp", v.get("pp_size", 1)))
        except (TypeError, ValueError, AttributeError):
            raise ChooserError(f"para-config entry {key!r}: {v!r} is not {{dp, tp, pp}}") from None
        if dp * tp * pp != n:
            raise ChooserError(f"para-config entry {key}: dp*tp*pp = {dp * tp * pp}, not {n}")
        out[n] = Layout(dp, tp, pp)
    return out


def choose(
    model: str,
    devices: int,
    global_batch: int,
    micro_batch: int = 0,
    table: dict | None = None,
    device_memory: int | None = None,
) -> Layout:
    if table:
        chosen = parse_table(table).get(devices)
        if chosen is not None:
            chosen.check(preset(model), devices)
            return chosen
    ranked = rank_layouts(model, devices, global_batch, micro_batch, device_memory)
    # the architecture allows more than the reference workload runs (tied embeddings: tp = pp = 1)
    runnable = [e.layout for e in ranked if e.layout.allowed(preset(model), devices)]
    if not runnable:
        raise ChooserError(
            f"no layout of {model} fits {devices} devices with global batch {global_batch}"
            + (f" and {device_memory} bytes per device" if device_memory else "")
        )
    return runnable[0]
