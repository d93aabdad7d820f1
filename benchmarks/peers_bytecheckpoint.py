"""ByteCheckpoint in benchmarks/bench_peers.py: the same state saved by one world and loaded by another, under
ByteCheckpoint's own torch (`bytecheckpoint==0.0.2` requires torch <= 2.5.0) in a venv of its own.

`run_bytecheckpoint` (the benchmark's side, any torch) starts a world of the source's size that saves and one
of the target's size that loads, as subprocesses of the benchmark run; each rank's `main` (ByteCheckpoint's
side) wraps its part of the state in an nn.Module (DTensor parameters for FSDP2, plain ones for DDP) and an
AdamW holding the moments, times `bytecheckpoint.save` / `load` between barriers and checks every loaded
tensor bit for bit. Where ByteCheckpoint cannot run, the row gets the reason instead of figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from tenplex.util.ranks import RanksFailed, run_local

HERE = Path(__file__).resolve().parent
# (framework, source mesh, target mesh) as (replicate, shard) per case of bench_peers
CASES = {"fsdp": ("fsdp2", (1, 4), (1, 3)), "dp": ("ddp", (2, 1), (4, 1))}
# PyPI's torch 2.5.0 (its CUDA build, which runs on CPU; about 3 GB with its libraries): the PyTorch CPU
# wheel index is another host, and ByteCheckpoint's own requirements are met by it
SETUP = (
    "python3.11 -m venv .venv-bytecheckpoint && "
    ".venv-bytecheckpoint/bin/pip install torch==2.5.0 numpy bytecheckpoint==0.0.2"
)


def run_bytecheckpoint(python: str, case: str, model: dict, root: Path, repeat: int, timeout: float) -> dict:
    """`bytecheckpoint_save_s` / `_load_s` (best and `_first` repetition, slowest rank) and
    `bytecheckpoint_bad`, or `bytecheckpoint_why` when it cannot run here."""
    why = unavailable(python)
    if why:
        return {"bytecheckpoint_why": why}
    framework, a, b = CASES[case]
    path = root / f"bytecheckpoint-{case}"
    per = {}
    for phase, mesh in (("save", a), ("load", b)):
        spec = {"phase": phase, "framework": framework, "mesh": mesh, "model": model, "path": str(path),
                "repeat": repeat}  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="tenplex-bench-bcp-") as out:
            env = dict(os.environ, TENPLEX_BENCH_SPEC=json.dumps(spec), TENPLEX_BENCH_OUT=out,
                       OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent / "src")]),
                       BYTECHECKPOINT_LOGGING_LEVEL="WARNING")  # fmt: skip
            try:
                run_local([python, "-m", "peers_bytecheckpoint"], mesh[0] * mesh[1], env=env, timeout=timeout)
            except RanksFailed as err:
                return {"bytecheckpoint_why": f"its {phase} world failed (ranks {err.failed}; output above)"}
            per[phase] = [json.loads(f.read_text()) for f in sorted(Path(out).glob("rank*.json"))]
    row: dict = {"bytecheckpoint_bad": sorted({b for r in per["load"] for b in r["bad"]})}
    for phase, ranks in per.items():
        each = [max(r["seconds"][i] for r in ranks) for i in range(repeat)]
        row[f"bytecheckpoint_{phase}_s"], row[f"bytecheckpoint_{phase}_s_first"] = min(each), each[0]
        row[f"bytecheckpoint_{phase}_s_warmup"] = max(r["warmup"] for r in ranks)
    row["bytecheckpoint_torch"] = per["save"][0]["torch"]
    return row


def unavailable(python: str) -> str | None:
    """Why ByteCheckpoint cannot run from `python`, or None."""
    if not Path(python).exists():
        return f"no venv with torch<=2.5.0 for it (bytecheckpoint==0.0.2 requires it); make one: {SETUP}"
    probe = "import torch, bytecheckpoint; print(torch.__version__)"
    got = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    if got.returncode != 0:
        last = (got.stderr.strip().splitlines() or ["?"])[-1]
        return f"import bytecheckpoint failed under {python}: {last}"
    return None


def main() -> None:
    import bytecheckpoint
    import torch
    import torch.distributed as dist

    from peers_state import build, check, copy_into, layout, zero
    from tenplex.ptc.gpt import GPTConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = json.loads(os.environ["TENPLEX_BENCH_SPEC"])
    cfg = GPTConfig(**spec["model"])
    plain = spec["framework"] == "ddp"
    sd = build(cfg, layout(*spec["mesh"]), rank, zeros=spec["phase"] == "load")
    model, optim = as_module(sd, plain)
    seconds, bad = [], []
    # repetition -1 is the warm-up, as the other systems' (its first save starts ByteCheckpoint's RPC service:
    # ~10 s here), timed but not counted
    for i in range(-1, spec["repeat"]):
        path = f"{spec['path']}/{i}"
        state = {"model": model, "optimizer": optim}
        dist.barrier()
        t = time.perf_counter()
        if spec["phase"] == "save":
            bytecheckpoint.save(path, state, framework=spec["framework"])
        else:
            bytecheckpoint.load(path, state, framework=spec["framework"])
        seconds.append(time.perf_counter() - t)
        dist.barrier()
        if spec["phase"] == "load":
            copy_into(sd, from_module(model, optim))
            bad += check(sd)
            zero(sd)
            model, optim = as_module(sd, plain)
    out = Path(os.environ["TENPLEX_BENCH_OUT"]) / f"rank{rank}.json"
    out.write_text(json.dumps({"warmup": seconds[0], "seconds": seconds[1:], "bad": bad[:5],
                               "torch": torch.__version__}))  # fmt: skip
    dist.destroy_process_group()


def as_module(sd: dict, plain: bool):
    """An nn.Module whose parameters are the state's (the DTensors, or their local tensors for DDP) under
    their fully qualified names, and an AdamW whose state holds the moments and step."""
    import torch

    root = torch.nn.Module()
    params = {}
    for fqn, t in sd["model"].items():
        *path, leaf = fqn.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        p = torch.nn.Parameter(t.to_local() if plain else t)
        mod.register_parameter(leaf, p)
        params[fqn] = p
    group = dict(sd["optim"]["param_groups"][0])
    optim = torch.optim.AdamW(list(params.values()), **{k: tuple(v) if k == "betas" else v
                                                        for k, v in group.items()})  # fmt: skip
    for fqn, p in params.items():
        st = sd["optim"]["state"][fqn]
        optim.state[p] = {k: (v.to_local() if plain and k != "step" else v) for k, v in st.items()}
    return root, optim


def from_module(model, optim) -> dict:
    """The loaded module's and optimizer's tensors in the state dict's shape (for the check)."""
    params = dict(model.named_parameters())
    by_id = {id(p): fqn for fqn, p in params.items()}
    state = {by_id[id(p)]: st for p, st in optim.state.items()}
    return {"model": {fqn: p.detach() for fqn, p in params.items()}, "optim": {"state": state}}


if __name__ == "__main__":
    main()
