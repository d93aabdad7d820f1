"""Worker for tests/test_megatron.py: a tiny Megatron-core GPTModel resharded on 2 gloo ranks.

(tp 2) saved through tenplex and through Megatron's `dist_checkpointing` (torch_dist); loaded at (dp 2,
tp 1) and at (pp 2) by both, bit for bit against each other and against the source's full tensors; the
(pp 2) state saved and loaded back at (tp 2). Then what tenplex must refuse, each a TenplexError.
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.tensor import DTensor

import megatron_cpu as mc
import tenplex
from launch import write_result
from tenplex.integrations.megatron import model_state
from tenplex.integrations.megatron_checkpoint import export_torch_dist, import_torch_dist
from tenplex.integrations.megatron_train import MegatronState
from tenplex.ptc import TenplexError

JOB = "megatron-test"


def full(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor whole (a DTensor gathered over its TP group), copied."""
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for n, t in state.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> list[str]:
    """Names whose whole tensors are not bitwise equal (or missing); `got` covers this rank's stage."""
    bad = [f"{n}: {what}: missing" for n in got if n not in want]
    return bad + [
        f"{n}: {what}" for n, t in full(got).items() if n in want and not torch.equal(bits(t), bits(want[n]))
    ]


def scribbled(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor filled with -1, so that a tensor the load does not write is seen."""
    with torch.no_grad():
        for t in state.values():
            (t.to_local() if isinstance(t, DTensor) else t).fill_(-1.0)
    return state


def timed(fn, *args, **kwargs) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start


def megatron_load(tp: int, pp: int, path: str, seed: int) -> dict[str, torch.Tensor]:
    """A fresh model of the layout filled by Megatron's own `dist_checkpointing.load`."""
    model = mc.tiny_gpt(tp, pp, seed)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
    return model_state(model)


def reshard(path: str) -> dict:
    bad: list[str] = []
    unlike: dict[str, int] = {}  # the targets' tensors equal to the source's before the load: -0
    mc.init_parallel(tp=2)
    source = model_state(mc.tiny_gpt(2, 1, seed=0))
    want = full(source)
    seconds = {"tenplex save": timed(tenplex.save, {"model": source, "step": 1}, JOB, 1)}
    seconds["megatron save"] = timed(
        dist_checkpointing.save, mc.tiny_gpt(2, 1, seed=0).sharded_state_dict(), path
    )
    for tp, pp in ((1, 1), (1, 2)):
        mc.init_parallel(tp=tp, pp=pp)
        target = scribbled(model_state(mc.tiny_gpt(tp, pp, seed=1)))
        unlike[f"tp{tp} pp{pp}"] = len(differ(target, want, "before the load")) - len(target)
        seconds[f"tenplex load tp{tp} pp{pp}"] = timed(
            tenplex.load, {"model": target, "step": 0}, JOB, step=1
        )
        bad += differ(target, want, f"tenplex tp2 -> tp{tp} pp{pp}")
        start = time.perf_counter()
        theirs = megatron_load(tp, pp, path, seed=2)
        seconds[f"megatron load tp{tp} pp{pp} (with a model build)"] = time.perf_counter() - start
        bad += differ(theirs, full(target), f"dist_checkpointing tp{tp} pp{pp}")
    tenplex.save({"model": target, "step": 2}, JOB, 2)  # the (pp 2) state
    mc.init_parallel(tp=2)
    back = scribbled(model_state(mc.tiny_gpt(2, 1, seed=3)))
    tenplex.load({"model": back, "step": 0}, JOB, step=2)
    bad += differ(back, want, "tenplex pp2 -> tp2")
    return {"bad": bad, "names": sorted(want), "unlike": unlike, "seconds": seconds}


def trained(tp: int, seed: int) -> MegatronState:
    """A tiny model after one AdamW step (so that the moments are not zero), as the job's state."""
    model = mc.tiny_gpt(tp, 1, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(seed))
    mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1).view(1, 1, 16, 16)
    model(batch[:, :-1], torch.arange(16).unsqueeze(0), mask, labels=batch[:, 1:]).mean().backward()
    opt.step()
    return MegatronState(model, opt)


def optimizer_moves() -> list[str]:
    """MegatronState (model + AdamW moments and steps) saved at (tp 2), loaded at (dp 2, tp 1) into a
    model after another step: bit for bit."""
    mc.init_parallel(tp=2)
    source = trained(2, seed=0)()
    want = {k: full(source[k]) for k in ("model", "optim")}
    tenplex.save(source, JOB + "-optim", 1)
    mc.init_parallel(tp=1)
    target = trained(1, seed=1)()
    tenplex.load(target, JOB + "-optim")
    return [b for k in ("model", "optim") for b in differ(target[k], want[k], f"{k} tp2 -> tp1")]


def checkpoint_round_trip(root: str) -> list[str]:
    """The (tp 2) torch_dist checkpoint imported at (dp 2, tp 1), exported at (pp 2), read by Megatron at
    (tp 2): the source's tensors bit for bit."""
    mc.init_parallel(tp=1)
    import_torch_dist(mc.tiny_gpt(1, 1, seed=5), f"{root}/tp2", JOB + "-import", 1)
    mc.init_parallel(tp=1, pp=2)
    export_torch_dist(mc.tiny_gpt(1, 2, seed=6), JOB + "-import", f"{root}/exported")
    mc.init_parallel(tp=2)
    want = full(model_state(mc.tiny_gpt(2, 1, seed=0)))
    return differ(megatron_load(2, 1, f"{root}/exported", seed=7), want, "import tp1, export pp2, load tp2")


def load_into(model) -> None:
    tenplex.load({"model": model_state(model), "step": 0}, JOB, step=1)


def refusals() -> dict[str, str]:
    """Each case's error class and message (TenplexError expected), with the (tp 2) layout."""
    mc.init_parallel(tp=2)
    sd = mc.tiny_gpt(2, 1, seed=0).sharded_state_dict()
    st = sd["embedding.word_embeddings.weight"]
    other = 1 - parallel_state.get_tensor_model_parallel_rank()  # the other rank's rows claimed
    cases = {
        "object": lambda: model_state({"o": ShardedObject("o", {"a": 1}, (1,), (0,))}),
        "offset": lambda: model_state({"w": ShardedTensor.from_rank_offsets(st.key, st.data, (0, other, 2))}),
        "shape": lambda: load_into(mc.tiny_gpt(2, 1, seed=0, hidden=48)),
        "unknown key": lambda: load_into(mc.tiny_gpt(2, 1, seed=0, layers=3)),
    }
    out = {}
    for case, fn in cases.items():
        try:
            fn()
            out[case] = "no error"
        except TenplexError as e:
            out[case] = f"{type(e).__name__}: {e}"
        except Exception as e:  # anything else is a failure of the test
            out[case] = f"NOT A TenplexError {type(e).__name__}: {e}"
    return out


def main() -> None:
    dist.init_process_group("gloo")
    mc.on_cpu()
    try:
        root = os.environ["TENPLEX_TEST_DIR"]
        os.makedirs(f"{root}/tp2", exist_ok=True)
        result = reshard(f"{root}/tp2")
        result["refusals"] = refusals()
        result["optimizer_bad"] = optimizer_moves()
        result["checkpoint_bad"] = checkpoint_round_trip(root)
    except Exception:
        result = {"error": traceback.format_exc()}
    write_result(result)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
