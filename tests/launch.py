"""Run a test worker module in N real processes with a gloo process group, and collect their results.

Each rank runs `python -m <module>` with RANK / WORLD_SIZE / MASTER_* set, writes its result as JSON into
TENPLEX_TEST_OUT, and the launcher returns the list of results (or fails with the ranks' stderr).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from tenplex.util.ranks import RanksFailed, run_local

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def run_ranks(
    module: str,
    world: int,
    env: dict[str, str] | None = None,
    per_rank_env: list[dict[str, str]] | None = None,
    timeout: float = 600,
) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="tenplex-test-") as out:
        common = dict(os.environ)
        common.update(env or {})
        common.update(
            TENPLEX_TEST_OUT=out,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(HERE), str(SRC), common.get("PYTHONPATH", "")]),
        )
        try:
            run_local([sys.executable, "-m", module], world, env=common, per_rank_env=per_rank_env,
                      timeout=timeout, capture=True)  # fmt: skip
        except RanksFailed as e:
            tail = "\n".join(f"--- rank {r} ---\n{log[-4000:]}" for r, log in enumerate(e.logs))
            raise AssertionError(f"ranks {e.failed} failed\n{tail}") from None
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]


def write_result(result: dict) -> None:
    out = Path(os.environ["TENPLEX_TEST_OUT"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(result))
