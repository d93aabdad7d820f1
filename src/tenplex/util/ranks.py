"""Local rank processes in a torchrun-style environment: the one launcher of the tests, the benchmarks, the
training launcher and the controller (which hands the same environment to its standby processes).

Torch-free and below every layer: a rank is `argv` in a process whose RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_* say where it stands; `torch.distributed.init_process_group` reads them.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence

from .net import free_port

Popen = Callable[[int, list[str], dict[str, str]], subprocess.Popen]  # rank, argv, env -> its process


class RanksFailed(RuntimeError):
    """Ranks exited non-zero (or ran past the timeout); `failed` holds (rank, exit code), `logs` their
    output when it was captured."""

    def __init__(self, failed: list[tuple[int, int | None]], logs: list[str]) -> None:
        super().__init__(f"ranks {failed} failed")
        self.failed, self.logs = failed, logs


def rank_env(
    rank: int, world: int, port: int, master: str = "127.0.0.1", local_rank: int | str | None = None
) -> dict[str, str]:
    """The variables torch.distributed's env:// rendezvous reads, for one rank."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
    }


def run_local(
    argv: list[str],
    world: int,
    *,
    env: Mapping[str, str] | None = None,
    per_rank_env: Sequence[Mapping[str, str]] | None = None,
    timeout: float = 600,
    master: tuple[str, int] | None = None,
    popen: Popen | None = None,
    capture: bool = False,
) -> list[str]:
    """Run `argv` as ranks 0..world-1 (environment: `env`, then `per_rank_env[r]`, then the rank's own)
    until all exit; their output if `capture`. Raises `RanksFailed`; no rank outlives the call. `master`:
    where rank 0 listens (default: loopback, a free port); `popen` starts a rank elsewhere (a namespace
    host, say)."""
    master, port = master or ("127.0.0.1", free_port())
    out = subprocess.PIPE if capture else None

    def start(r: int, argv: list[str], e: dict[str, str]) -> subprocess.Popen:
        err = subprocess.STDOUT if capture else None
        return subprocess.Popen(argv, env=e, stdout=out, stderr=err, text=True)

    procs: list[subprocess.Popen] = []
    logs: list[str] = []
    try:
        for r in range(world):
            own = per_rank_env[r] if per_rank_env else {}
            # a rank that dies of a signal (an abort in C++, a segfault) prints its Python stacks first
            e = {"PYTHONFAULTHANDLER": "1", **(env or {}), **own, **rank_env(r, world, port, master)}
            procs.append((popen or start)(r, list(argv), e))
        for p in procs:
            if capture:
                logs.append(p.communicate(timeout=timeout)[0] or "")
            else:
                p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass  # reported below as the ranks still running
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RanksFailed(failed, logs)
    return logs
