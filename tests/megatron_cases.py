"""Worker for tests/test_megatron.py: a tiny Megatron-core GPTModel resharded on 2 gloo ranks.

The reference is Megatron's own: the (tp 2) model saved with `dist_checkpointing` (torch_dist) and read
back whole (`read_torch_dist`, keys and global shapes as the checkpoint holds them). tenplex's save at (tp 2)
is loaded at (dp 2, tp 1) and at (pp 2), bit for bit against it, as is Megatron's own load; the (pp 2)
state goes back to (tp 2). AdamW moments across a TP change. The torch_dist folder goes through the CLI
(`tenplex import megatron`, then `tenplex export megatron` and `tenplex export dcp`, real subprocesses)
into jobs at (pp 2) and (dp 2) and back to Megatron's and torch's loaders. Then what tenplex must refuse.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

import megatron_cpu as mc
import tenplex
from launch import write_result
from tenplex.integrations.megatron import model_state
from tenplex.integrations.megatron_checkpoint import import_checkpoint, read_torch_dist
from tenplex.integrations.megatron_train import MegatronState
from tenplex.ptc import TenplexError
from tenplex.transformer.durable import assemble
from tenplex.transformer.shards import PIECE

JOB = "megatron-test"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> list[str]:
    """Names whose box on this rank is not bitwise equal to that box of the whole tensor in `want`."""
    bad = []
    for name, t in got.items():
        if name not in want:
            bad.append(f"{name}: {what}: missing")
            continue
        _, start = getattr(t, PIECE)
        region = want[name][tuple(slice(a, a + n) for a, n in zip(start, t.shape))]
        if not torch.equal(bits(t), bits(region)):
            bad.append(f"{name}: {what}")
    return bad


def tensors(model) -> dict[str, torch.Tensor]:
    """The model's tensors as tenplex names them, freshly taken from its parameters."""
    return model_state(model).tensors


def scribbled(model):
    """Every parameter filled with -1, so that a tensor the load does not write is seen."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
    return model


def timed(fn, *args, **kwargs) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start


def megatron_load(tp: int, pp: int, path: str, seed: int):
    """A fresh model of the layout filled by Megatron's own `dist_checkpointing.load`."""
    model = mc.tiny_gpt(tp, pp, seed)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
    return model


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tenplex.cli.main", *args], capture_output=True, text=True)


def on_rank0(*args: str) -> list[str]:
    """The command run by rank 0 (the others wait); its failure as a bad entry."""
    bad = []
    if dist.get_rank() == 0:
        r = cli(*args)
        if r.returncode != 0:
            bad.append(f"tenplex {' '.join(args[:2])}: rc {r.returncode}: {r.stderr.strip()[-400:]}")
    dist.barrier()
    return bad


def reshard(path: str) -> dict:
    bad: list[str] = []
    unlike: dict[str, int] = {}  # the targets' tensors equal to the reference before the load: 0
    mc.init_parallel(tp=2)
    source = mc.tiny_gpt(2, 1, seed=0)
    seconds = {"megatron save": timed(dist_checkpointing.save, source.sharded_state_dict(), path)}
    want = read_torch_dist(path)
    bad += differ(tensors(source), want, "source against Megatron's checkpoint")
    seconds["tenplex save"] = timed(tenplex.save, {"model": model_state(source)}, JOB, 1)
    for tp, pp in ((1, 1), (1, 2)):
        mc.init_parallel(tp=tp, pp=pp)
        target = scribbled(mc.tiny_gpt(tp, pp, seed=1))
        unlike[f"tp{tp} pp{pp}"] = len(differ(tensors(target), want, "before")) - len(tensors(target))
        seconds[f"tenplex load tp{tp} pp{pp}"] = timed(
            tenplex.load, {"model": model_state(target)}, JOB, step=1
        )
        bad += differ(tensors(target), want, f"tenplex tp2 -> tp{tp} pp{pp}")
        start = time.perf_counter()
        theirs = megatron_load(tp, pp, path, seed=2)
        seconds[f"megatron load tp{tp} pp{pp} (with a model build)"] = time.perf_counter() - start
        bad += differ(tensors(theirs), want, f"dist_checkpointing tp{tp} pp{pp}")
    tenplex.save({"model": model_state(target)}, JOB, 2)  # the (pp 2) state
    mc.init_parallel(tp=2)
    back = scribbled(mc.tiny_gpt(2, 1, seed=3))
    tenplex.load({"model": model_state(back)}, JOB, step=2)
    bad += differ(tensors(back), want, "tenplex pp2 -> tp2")
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


def optimizer_moves(root: str) -> list[str]:
    """MegatronState (model + AdamW moments and steps) saved at (tp 2), loaded at (dp 2, tp 1) into a
    model after another step: bit for bit against the saved snapshot, read whole. Its model exported by the
    CLI as torch_dist (the moments left out) and read by Megatron at (tp 2)."""
    mc.init_parallel(tp=2)
    tenplex.save(trained(2, seed=0)(), JOB + "-optim", 1)
    _, _, saved = assemble(JOB + "-optim")
    mc.init_parallel(tp=1)
    state = trained(1, seed=1)
    tenplex.load(state(), JOB + "-optim")
    after = state()  # taken afresh from the parameters and the optimizer: the stacked copies written back
    bad = [
        b for k in ("model", "optim") for b in differ(after[k].tensors, strip(saved, k), f"{k} tp2 -> tp1")
    ]
    bad += on_rank0("export", "megatron", f"{root}/from-state", "--job", JOB + "-optim")
    mc.init_parallel(tp=2)
    theirs = megatron_load(2, 1, f"{root}/from-state", seed=4)
    return bad + differ(tensors(theirs), strip(saved, "model"), "MegatronState exported, Megatron's load")


def strip(saved: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {n[len(prefix) + 1 :]: t for n, t in saved.items() if n.startswith(prefix + ".")}


def checkpoint_round_trip(root: str) -> list[str]:
    """The (tp 2) torch_dist folder imported by the CLI, loaded at (pp 2) and at (dp 2, tp 1), exported by
    the CLI as torch_dist (read by Megatron at (tp 2)) and as DCP (read by torch): bit for bit."""
    want = read_torch_dist(f"{root}/tp2")
    job = JOB + "-import"
    bad = on_rank0("import", "megatron", f"{root}/tp2", "--job", job, "--step", "3")
    for tp, pp in ((1, 2), (1, 1)):
        mc.init_parallel(tp=tp, pp=pp)
        target = scribbled(mc.tiny_gpt(tp, pp, seed=5))
        # a MegatronState job's model, before its optimizer has state (the import holds none)
        state = MegatronState(target, torch.optim.AdamW(target.parameters()))
        tenplex.load({"model": state()["model"]}, job)
        state.start_fresh()
        bad += differ(tensors(target), want, f"imported, loaded at tp{tp} pp{pp}")
    bad += on_rank0("export", "megatron", f"{root}/exported", "--job", job)
    mc.init_parallel(tp=2)
    bad += differ(tensors(megatron_load(2, 1, f"{root}/exported", seed=7)), want, "exported, Megatron's load")
    bad += on_rank0("export", "dcp", f"{root}/dcp", "--job", job)
    if dist.get_rank() == 0:
        read = {f"model.{k}": torch.zeros_like(t) for k, t in want.items() if isinstance(t, torch.Tensor)}
        dcp.load(read, checkpoint_id=f"{root}/dcp", no_dist=True)
        bad += [f"{n}: export dcp" for n, t in read.items() if not torch.equal(bits(t), bits(want[n[6:]]))]
    return bad


def refusals() -> dict[str, str]:
    """Each case's error class and message (TenplexError expected), with the (tp 2) layout."""
    mc.init_parallel(tp=2)
    cases = {
        "object": lambda: model_state({"o": ShardedObject("o", {"a": 1}, (1,), (0,))}),
        "shape": lambda: tenplex.load(
            {"model": model_state(mc.tiny_gpt(2, 1, seed=0, hidden=48))}, JOB, step=1
        ),
        "import in a group": lambda: import_checkpoint(f"{os.environ['TENPLEX_TEST_DIR']}/tp2", JOB + "-x"),
        "layers": lambda: tenplex.load(
            {"model": model_state(mc.tiny_gpt(2, 1, seed=0, layers=3))}, JOB, step=1
        ),
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
        result["optimizer_bad"] = optimizer_moves(root)
        result["checkpoint_bad"] = checkpoint_round_trip(root)
    except Exception:
        result = {"error": traceback.format_exc()}
    write_result(result)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
