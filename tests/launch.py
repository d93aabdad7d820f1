"""Run a test worker module in N real processes with a gloo process group, and collect their results.

Each rank runs `python -m <module>` with RANK / WORLD_SIZE / MASTER_* set, writes its result as JSON into
TENPLEX_TEST_OUT, and the launcher returns the list of results (or fails with the ranks' stderr).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tenplex.util import free_port

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def run_ranks(
    module: str,
    world: int,
    env: dict[str, str] | None = None,
    per_rank_env: list[dict[str, str]] | None = None,
    timeout: float = 600,
) -> list[dict]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tenplex-test-") as out:
        procs = []
        for r in range(world):
            e = dict(os.environ)
            e.update(env or {})
            e.update((per_rank_env or [{}] * world)[r])
            e.update(
                RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), TENPLEX_TEST_OUT=out, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(HERE), str(SRC), e.get("PYTHONPATH", "")]),
            )  # fmt: skip
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module],
                    env=e,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            tail = "\n".join(
                f"--- rank {r} (exit {p.returncode}) ---\n{logs[r][-4000:]}" for r, p in enumerate(procs)
            )
            raise AssertionError(f"ranks {failed} failed\n{tail}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def write_result(result: dict) -> None:
    out = Path(os.environ["TENPLEX_TEST_OUT"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(result))
