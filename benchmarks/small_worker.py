"""One rank of benchmarks/bench_small.py: small states, tenplex against DCP on the same ranks, interleaved.

States (spec "states"): the Hugging Face Llama of tests/test_hf.py (FSDP2 over its decoder layers) and
torchtitan's Llama 3 of tests/test_titan.py (its own `parallelize_llama`), each after one AdamW step so that
every moment is non-zero, as `TrainState` hands them to tenplex (DCP's state-dict API, flattened optimizer);
and `tiny`, a few small Shard(0) DTensors and a value, for the fixed cost per save and load. Per repetition,
alternating which system goes first: tenplex `save` + `load` into the same layout and into another one
(`reshard`), DCP `save` + `load` of both through /dev/shm. Every load fills zeroed targets, checked bit for
bit against the source's full tensors. Results: $TENPLEX_BENCH_OUT/rank<r>.json.
"""

from __future__ import annotations

import cProfile
import json
import os
import shutil
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import tenplex
from reconfig_worker import timed
from tenplex.integrations import TrainState
from tenplex.store.transport import Transport

TIMEOUT = timedelta(seconds=600)
COLLECTIVES = ("gather", "broadcast", "all_gather", "barrier", "broadcast_object_list", "all_gather_object",
               "all_reduce", "scatter", "reduce")  # fmt: skip


class Counts:
    """Round trips to the stores (each HTTP exchange, a request sent without waiting included) and
    collectives (each torch.distributed call tenplex makes), counted for one call at a time."""

    def __init__(self) -> None:
        self.now: dict[str, int] = {}
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(getattr(dist, name), f"collective.{name}"))
        for name in ("_exchange", "send_only"):
            setattr(Transport, name, self._wrap(getattr(Transport, name), "store_requests"))

    def _wrap(self, fn: Callable, key: str) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.now[key] = self.now.get(key, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def of(
        self, fn: Callable[[], Any], into: dict, key: str, profile: str | None = None
    ) -> Callable[[], Any]:
        """`fn`, counting its calls into `into[key]` (and profiling it with cProfile into `profile`)."""

        def run() -> Any:
            self.now = {}
            prof = cProfile.Profile() if profile else None
            try:
                return prof.runcall(fn) if prof else fn()
            finally:
                into[key] = dict(self.now)
                if prof:
                    prof.dump_stats(profile)

        return run


COUNTS: Counts


def hf_model(world: int, reshard: bool) -> torch.nn.Module:
    """FSDP2 over the ranks; resharded: HSDP, 2 replicas of a world/2-way shard."""
    from tenplex.integrations.hf import shard, tiny_causal_lm

    shape, names = ((2, world // 2), ("rep", "shard")) if reshard else ((world,), ("shard",))
    return shard(tiny_causal_lm("llama", seq=32), init_device_mesh("cpu", shape, mesh_dim_names=names))


def titan_model(world: int, reshard: bool) -> torch.nn.Module:
    """FSDP2 over the ranks; resharded: tensor parallelism 2 (with FSDP2 over the rest)."""
    from tenplex.integrations.titan import TinyLlama, build_llama3, parallelize

    model = build_llama3(TinyLlama(max_seq_len=32), seed=0)
    parallelize(model, world, 2 if reshard else 1)
    return model


def trained_state(kind: str, world: int, reshard: bool) -> dict[str, Any]:
    """The state after one AdamW step on a fixed batch (so every moment is non-zero)."""
    model = (hf_model if kind == "hf" else titan_model)(world, reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    batch = torch.randint(0, 256, (2, 33))
    out = model(input_ids=batch[:, :-1]).logits if kind == "hf" else model(batch[:, :-1])
    out = out.full_tensor() if isinstance(out, DTensor) else out
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return TrainState(model, opt)()


def tiny_state(world: int, tensors: int = 8) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    full = {f"t{i}": torch.arange(world * 16, dtype=torch.float32) + i for i in range(tensors)}
    return {"model": {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}, "step": 3}


def tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, dict):
        out: dict[str, torch.Tensor] = {}
        for k, v in tree.items():
            out.update(tensors(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree} if isinstance(tree, torch.Tensor) else {}


def full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor whole (a collective for DTensors: outside the timed parts)."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).clone() for n, t in tensors(state).items()}


def zero(state: dict[str, Any]) -> None:
    for t in tensors(state).values():
        (t.to_local() if isinstance(t, DTensor) else t).zero_()


def check(state: dict[str, Any], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose loaded values differ from the source's, bit for bit."""
    got = full(state)
    bad = [n for n in sorted(expected) if n not in got or not torch.equal(_bits(got[n]), _bits(expected[n]))]
    return bad + sorted(set(got) - set(expected))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def run_state(spec: dict, name: str, src: dict, targets: dict[str, dict], rep: int) -> dict:
    """One repetition on one state: tenplex and DCP, in an order that alternates with `rep`."""
    expected = full(src)
    out: dict[str, Any] = {}
    counts = out["counts"] = {}
    job = f"small-{name}"  # periodic saves of one job: step `rep`, the two newest kept, as ElasticJob does
    shm = Path(spec["shm_dir"]) / f"{job}-{rep}"

    def run_tenplex() -> None:
        save = lambda: tenplex.save(src, job=job, step=rep, keep=2)  # noqa: E731
        out["tenplex_save"], h = timed(
            COUNTS.of(save, counts, "save", _profile(spec, name, rep, "save")), True
        )
        out["save_phases"] = h.phases
        for what, dst in targets.items():
            zero(dst)
            load = COUNTS.of(partial(tenplex.load, dst, job=job), counts, f"load_{what}",
                             _profile(spec, name, rep, f"load_{what}"))  # fmt: skip
            out[f"tenplex_load_{what}"], info = timed(load, True)
            out[f"load_phases_{what}"] = info.phases
            out.setdefault("bad", []).extend(f"tenplex {what}: {b}" for b in check(dst, expected))

    def run_dcp() -> None:
        out["dcp_save"], _ = timed(lambda: dcp.save(src, checkpoint_id=str(shm)), True)
        for what, dst in targets.items():
            zero(dst)
            out[f"dcp_load_{what}"], _ = timed(partial(dcp.load, dst, checkpoint_id=str(shm)), True)
            out.setdefault("bad", []).extend(f"dcp {what}: {b}" for b in check(dst, expected))

    for fn in (run_tenplex, run_dcp) if rep % 2 == 0 else (run_dcp, run_tenplex):
        fn()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(shm, ignore_errors=True)
    return out


def _profile(spec: dict, name: str, rep: int, what: str) -> str | None:
    """Where rank 0 writes the cProfile of `what` in the last repetition, when profiling."""
    last = rep == spec["warmup"] + spec["repeat"] - 1
    if not spec.get("profile") or not last or dist.get_rank() != 0:
        return None
    return str(Path(spec["profile"]) / f"{name}-{dist.get_world_size()}-{what}.prof")


def states(spec: dict, world: int) -> dict[str, tuple[dict, dict[str, dict]]]:
    """Per state: the source and the targets (the same layout, and `reshard` where the world allows one)."""
    out = {}
    for kind in spec["states"]:
        if kind == "tiny":
            out["tiny"] = (tiny_state(world), {"same": tiny_state(world)})
            continue
        targets = {"same": trained_state(kind, world, False)}
        if world % 2 == 0:
            targets["reshard"] = trained_state(kind, world, True)
        out[kind] = (trained_state(kind, world, False), targets)
    return out


def main() -> None:
    global COUNTS
    spec = json.loads(os.environ["TENPLEX_BENCH_SPEC"])
    COUNTS = Counts()
    os.environ["TENPLEX_STORE"] = spec["store"]  # the ranks' own store: shared memory
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    made = states(spec, world)
    result: dict[str, Any] = {"rank": rank, "world": world, "states": {}}
    for name, (src, targets) in made.items():
        result["states"][name] = {
            "tensors": len(tensors(src)),
            "bytes": sum(t.numel() * t.element_size() for t in full(src).values()),
            "reps": [run_state(spec, name, src, targets, k) for k in range(spec["warmup"] + spec["repeat"])],
        }
    Path(os.environ["TENPLEX_BENCH_OUT"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
