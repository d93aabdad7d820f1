"""Accelerator state through the store: a snapshot's stall on the training stream, its commit, and a load
back into GPU tensors, against DCP on /dev/shm and the copy engine's floor, in the same run.

One process (a gloo world of 1, so both libraries take their distributed paths) holds `--size` GiB of
fp32 and bf16 tensors on the GPU. Each repetition:

- `snapshot`: `tenplex.save(async_save=True)`; `stall` is until the call returned and the training
  stream may run again (its next kernels wait for the staging copies), `commit` until the version
  committed. Baseline: `dcp.async_save` to /dev/shm, timed the same way.
- `save`: a synchronous save, against `dcp.save` to /dev/shm.
- `load`: into GPU tensors of the same layout, against `dcp.load` from /dev/shm.

The store reserves two versions' memory at start, as a deployment would. The floor is the bytes over
the measured device-to-host (pinned) and host-to-device bandwidth. The first repetition (no staging
buffers yet) is reported on its own; the later ones count their best. After every snapshot the tensors
are changed on the training stream right away, and every load is compared with the values at the
snapshot bit for bit (`bad`).

    python benchmarks/bench_cuda.py [--size 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from common import entry, print_rows, write_results

GiB = 1 << 30


def make_state(size: float, device: str) -> dict:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    n = max(1, int(size * GiB) // (64 << 20))  # 64 MiB tensors, every fourth in bf16 (half the bytes)
    state = {}
    for i in range(n):
        dtype = torch.bfloat16 if i % 4 == 3 else torch.float32
        state[f"layer{i}.weight"] = torch.randn(4096, 4096, generator=g, device=device).to(dtype)
    state["step"] = 0
    return state


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if hasattr(t, "numel"))


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_floor(state: dict, device: str) -> tuple[float, float]:
    """Device-to-host and host-to-device GB/s into and out of preallocated pinned buffers (best of 3)."""
    import torch

    tensors = [t for t in state.values() if hasattr(t, "numel")]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=device == "cuda") for t in tensors]
    best = [float("inf"), float("inf")]
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        sync(device)
        t1 = time.perf_counter()
        for h, t in zip(host, tensors):
            t.copy_(h, non_blocking=True)
        sync(device)
        best = [min(best[0], t1 - t0), min(best[1], time.perf_counter() - t1)]
    return nbytes(state) / best[0] / 1e9, nbytes(state) / best[1] / 1e9


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def one_round(state: dict, rnd: int, store: str, shm: Path, device: str, bad: list) -> dict[str, float]:
    """Every operation once, both libraries; seconds by name."""
    import torch
    import torch.distributed.checkpoint as dcp

    import tenplex

    out: dict[str, float] = {}
    want = {k: v.clone() for k, v in state.items() if hasattr(v, "clone")}

    def change() -> None:  # the optimizer's step right after the snapshot call: queued at once
        for v in state.values():
            if hasattr(v, "mul_"):
                v.mul_(-1)

    def snapshot(lib: str, start: Callable[[], Callable[[], object]]) -> None:
        """`start` begins the snapshot and returns what waits for its commit. The stall is the call plus
        the wait until the training stream may run its next kernels, which the change queues at once."""
        sync(device)
        t0 = time.perf_counter()
        finish = start()
        out[f"{lib}_call"] = time.perf_counter() - t0
        change()
        sync(device)
        out[f"{lib}_stall"] = time.perf_counter() - t0
        finish()
        out[f"{lib}_commit"] = time.perf_counter() - t0
        change()  # back to the snapshot's values

    snapshot("tenplex", lambda: tenplex.save(state, job="bench-cuda", step=2 * rnd + 1, store=store,
                                             async_save=True, keep=2).wait)  # fmt: skip
    target = shm / f"async-{rnd}"  # DCP's asynchronous save to /dev/shm, timed the same way
    snapshot("dcp", lambda: dcp.async_save(state, checkpoint_id=str(target)).result)
    shutil.rmtree(target)

    out["tenplex_save"] = timed(
        lambda: tenplex.save(state, job="bench-cuda", step=2 * rnd + 2, store=store, keep=2), device
    )
    target = shm / f"sync-{rnd}"
    out["dcp_save"] = timed(lambda: dcp.save(state, checkpoint_id=str(target)), device)

    # tenplex loads the asynchronous snapshot, the one the change raced against
    loaders = {"tenplex": lambda dest: tenplex.load(dest, job="bench-cuda", step=2 * rnd + 1, store=store),
               "dcp": lambda dest: dcp.load(dest, checkpoint_id=str(target))}  # fmt: skip
    for lib, load in loaders.items():
        dest = {k: torch.zeros_like(v) for k, v in want.items()} | {"step": -1}
        out[f"{lib}_load"] = timed(lambda: load(dest), device)  # noqa: B023 (called right here)
        bad += [f"{lib} round {rnd}: {k}" for k, v in want.items() if not torch.equal(dest[k], v)]
        if dest["step"] != state["step"]:
            bad.append(f"{lib} round {rnd}: step {dest['step']}")
    shutil.rmtree(target)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=float, default=1.0, help="GiB of state")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions after the first; the best counts")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the script")
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from tenplex.store import start_store
    from tenplex.util import free_port

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_cuda: no CUDA device here (--device cpu runs the script on the CPU)")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    state = make_state(args.size, args.device)
    size = nbytes(state)
    d2h, h2d = copy_floor(state, args.device)
    bad: list[str] = []
    # as a deployment starts its stores: the first two versions' pages taken at start (`--reserve`)
    sp = start_store(memory_limit=f"{int(4 * size / GiB) + 1}GiB", extra=["--reserve", str(2 * size)],
                     timeout=60 + 2 * size / 1e8)  # fmt: skip
    try:
        with tempfile.TemporaryDirectory(prefix="tenplex-bench-cuda-", dir="/dev/shm") as shm:
            rounds = [one_round(state, r, sp.url, Path(shm), args.device, bad)
                      for r in range(1 + args.repeat)]  # fmt: skip
    finally:
        sp.stop()
        dist.destroy_process_group()
    floors = {"snapshot": size / d2h / 1e9, "save": size / d2h / 1e9, "load": size / h2d / 1e9}
    rows = []
    first, steady = rounds[0], rounds[1:] or rounds
    for op, key in (("snapshot stall", "stall"), ("snapshot commit", "commit"), ("save", "save"),
                    ("load", "load")):  # fmt: skip
        best_t, best_d = (min(r[f"{lib}_{key}"] for r in steady) for lib in ("tenplex", "dcp"))
        first_t, first_d = first[f"tenplex_{key}"], first[f"dcp_{key}"]
        floor = floors[op.split()[0]]
        rows.append({"op": op, "tenplex_s": best_t, "dcp_shm_s": best_d, "x_dcp_shm": best_d / best_t,
                     "x_floor": best_t / floor, "first_tenplex_s": first_t, "first_dcp_shm_s": first_d,
                     "first_x_dcp_shm": first_d / first_t, "floor_s": floor})  # fmt: skip
    print_rows(f"{size / 1e9:.2f} GB of {args.device} state; best of {args.repeat} after the first; "
               f"floor: D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s",
               rows, ["op", "tenplex_s", "dcp_shm_s", "x_dcp_shm", "x_floor", "first_tenplex_s",
                      "first_dcp_shm_s", "first_x_dcp_shm"])  # fmt: skip
    print("bad:", bad or "none")
    command = "python benchmarks/bench_cuda.py" + (f" --size {args.size:g}" if args.size != 1 else "")
    meta = {"command": command,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__, "bytes": size, "d2h_gbps": d2h, "h2d_gbps": h2d,
            "repeat": args.repeat, "bad": bad, "rounds": rounds}  # fmt: skip
    print("wrote", write_results("bench_cuda", rows, meta, args.out))
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    entry(main)
