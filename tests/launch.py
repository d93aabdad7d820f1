"""Run a test worker module in N real processes with a gloo process group, and collect their results.

Each rank runs `python -m <module>` with RANK / WORLD_SIZE / MASTER_* set, writes its result as JSON into
TENPLEX_TEST_OUT, and the launcher returns the list of results (or fails with the ranks' stderr).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def on_two_hosts(module: str, timeout: float, env: dict[str, str] | None = None) -> Iterator[list[dict]]:
    """Four ranks of `module` on two emulated hosts (ranks 0-1 on one store, 2-3 on another, reached over
    sockets); `env` may name the stores as {a} and {b}. Yields the ranks' results, then stops the stores."""
    from tenplex.store import start_store

    a, b = start_store(), start_store()
    try:
        per_rank = [{"TENPLEX_STORE": s.url} for s in (a, a, b, b)]
        extra = {k: v.format(a=a.url, b=b.url) for k, v in (env or {}).items()}
        yield run_ranks(module, 4, env={"TENPLEX_EMULATED_HOSTS": "1", **extra}, per_rank_env=per_rank,
                        timeout=timeout)  # fmt: skip
    finally:
        a.stop()
        b.stop()


def write_result(result: dict) -> None:
    out = Path(os.environ["TENPLEX_TEST_OUT"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(result))
