"""Worker for tests/test_deepspeed.py: a tiny model under a DeepSpeed ZeRO engine (gloo, CPU, fp32).

`DS_MODE=save`: trains `STEPS` steps, saves the engine's state into the store with tenplex, writes the full
fp32 parameters and Adam moments (gathered by DeepSpeed's own `safe_get_full_*` API), the next global
batch's loss and the loss of one more training step to `DS_REF`. `DS_MODE=load`: builds a fresh engine
(another seed, any stage and world size), loads the snapshot, and compares the same gathered tensors with
`DS_REF` bit for bit; then the same next loss and the next step's. `DS_WIDTH` changes the model (bad input).
`DS_MODE=universal`: the same, loaded by DeepSpeed's own `load_checkpoint` from the universal checkpoint
folder `DS_EXPORT` (tenplex's export).
"""

from __future__ import annotations

import os
import sys
import traceback

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from torch import nn

import tenplex
from launch import write_result
from tenplex.integrations.deepspeed import DeepSpeedState, base_optimizer

CONTEXT, GLOBAL_BATCH, STEPS = 4, 6, 3


def build(
    stage: int, width: int, seed: int, frozen: bool = False, universal: bool = False
) -> deepspeed.DeepSpeedEngine:
    """Uneven sizes on purpose: ZeRO pads its partitions, and parameters straddle partition borders."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(256, 8), nn.Flatten(), nn.Linear(8 * CONTEXT, width), nn.GELU(), nn.Linear(width, 256)
    )
    model[0].weight.requires_grad_(not frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}},
        "checkpoint": {"load_universal": universal},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (GLOBAL_BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(step))


def train_step(engine: deepspeed.DeepSpeedEngine, step: int) -> float:
    """One step on this rank's part of global batch `step`; the mean loss over ranks."""
    part = batch(step).chunk(dist.get_world_size())[dist.get_rank()]
    loss = nn.functional.cross_entropy(engine(part[:, :CONTEXT]), part[:, CONTEXT])
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def next_loss(engine: deepspeed.DeepSpeedEngine, step: int) -> float:
    """The whole global batch's loss on every rank: bit for bit the same given the same weights."""
    engine.eval()
    with torch.no_grad():
        x = batch(step)
        loss = nn.functional.cross_entropy(engine(x[:, :CONTEXT]), x[:, CONTEXT]).item()
    engine.train()
    return loss


def gathered(engine: deepspeed.DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """The full fp32 master weights and moments as DeepSpeed itself assembles them (a collective)."""
    out = {}
    opt = base_optimizer(engine)
    for name, p in engine.module.named_parameters():
        if engine.zero_optimization_stage() == 0:
            out[f"master.{name}"] = p.detach().clone()
            out.update({f"{k}.{name}": opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")})
        else:
            out[f"master.{name}"] = safe_get_full_fp32_param(p).clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"{k}.{name}"] = safe_get_full_optimizer_state(p, k).clone()
    return out


def save_case(engine: deepspeed.DeepSpeedEngine, job: str, ref: str) -> dict:
    losses = [train_step(engine, s) for s in range(1, STEPS + 1)]
    tenplex.save(DeepSpeedState(engine)(), job=job, step=STEPS)
    if os.environ.get("DS_CHECKPOINT"):  # DeepSpeed's own checkpoint of the same state, for the importer
        engine.save_checkpoint(os.environ["DS_CHECKPOINT"], tag=f"global_step{STEPS}")
    full = gathered(engine)
    after = next_loss(engine, STEPS + 1), train_step(engine, STEPS + 1)
    if dist.get_rank() == 0:
        torch.save({"full": full, "next_loss": after[0], "step_loss": after[1]}, ref)
    return {"losses": losses}


def load_case(engine: deepspeed.DeepSpeedEngine, job: str, ref: str) -> dict:
    state = DeepSpeedState(engine)
    sd = state()
    info = tenplex.load(sd, job=job)
    state.restore(sd)
    return {"step": info.step, **compared(engine, ref)}


def universal_case(engine: deepspeed.DeepSpeedEngine, folder: str, ref: str) -> dict:
    """DeepSpeed's own load of a universal checkpoint (the tag `latest_universal` names)."""
    path, _ = engine.load_checkpoint(folder)
    assert path is not None, f"DeepSpeed loaded nothing from {folder}"
    return {"step": engine.global_steps, **compared(engine, ref)}


def compared(engine: deepspeed.DeepSpeedEngine, ref: str) -> dict:
    """The loaded state against the saved one (`ref`): the gathered tensors, the next loss and step's."""
    full, saved = gathered(engine), torch.load(ref)
    differ = sorted(k for k, t in saved["full"].items() if not torch.equal(full[k], t))
    result = {
        "names": sorted(full),
        "differ": differ,
        "global_steps": engine.global_steps,
        "lr": base_optimizer(engine).param_groups[0]["lr"],
        "adam_step": [s["step"].item() for s in base_optimizer(engine).state.values()],
        "next_loss": [next_loss(engine, STEPS + 1), saved["next_loss"]],
    }
    result["step_loss"] = [train_step(engine, STEPS + 1), saved["step_loss"]]
    return result


def run_case(mode: str, spec: str, job: str, ref: str) -> dict:
    """One engine, `spec` = STAGE[/WIDTH[/frozen]]; a TenplexError is a result (the bad-input cases)."""
    stage, width, frozen = [*spec.split("/"), "", ""][:3]
    try:
        seed = 0 if mode == "save" else 1  # a fresh engine unlike the saved one: the load must do it all
        engine = build(int(stage), int(width or 13), seed, frozen == "frozen", universal=mode == "universal")
        if mode == "universal":
            result = universal_case(engine, os.environ["DS_EXPORT"], ref)
        else:
            result = (save_case if mode == "save" else load_case)(engine, job, ref)
        engine.destroy()
        return result
    except tenplex.TenplexError as e:
        return {"error": type(e).__name__, "message": str(e)}
    except Exception:
        return {"error": "crash", "message": traceback.format_exc()}


def main() -> None:
    """`DS_CASES`: the engines to build one after the other in this world (each as `run_case` says)."""
    deepspeed.init_distributed(dist_backend="gloo")
    mode, job, ref = os.environ["DS_MODE"], os.environ["DS_JOB"], os.environ["DS_REF"]
    write_result({"cases": [run_case(mode, spec, job, ref) for spec in os.environ["DS_CASES"].split(",")]})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # the results are written: end here, not in the interpreter's teardown, where DeepSpeed's C++ threads
    # were seen to abort a ZeRO-3 process after its work was done ("terminate called without an active
    # exception", SIGABRT: the suite of 2026-12-06). A case that fails before this line still fails the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
