"""An agent's workers (`runtime/workers.py`, real processes forked from the zygote) in a round that breaks
while its planned end is awaited: one worker's script fails (as on a collective that broke), the other's
hangs (as in a collective with it, which gloo cannot abort). The wait for the round's end, meant for a
planned change (minutes), shrinks to the broken round's once the failure is seen: the hung worker is
replaced by a fresh fork within about a second, and both slots count as failed."""

from __future__ import annotations

import time

import pytest

from tenplex.runtime.records import Records
from tenplex.runtime.rounds import Round
from tenplex.runtime.workers import Workers

pytestmark = pytest.mark.dist

SCRIPT = """
import os, time
if os.environ["LOCAL_RANK"] == "0":
    raise RuntimeError("a collective broke: connection closed by peer")
time.sleep(3600)  # stuck in a collective with the failed one
"""


def test_a_round_that_breaks_while_its_end_is_awaited_waits_only_briefly(tmp_path) -> None:
    script = tmp_path / "worker_script.py"
    script.write_text(SCRIPT)
    workers = Workers([str(script)], 2, "park", tmp_path, Records(tmp_path / "agent.jsonl"))
    try:
        rnd = Round(1, 0, 1, 0, 2, "127.0.0.1:1", "http://127.0.0.1:1", [], devices=[0, 1])
        hung = workers.slots[1].proc
        workers.hand(rnd)
        t = time.monotonic()
        failed = workers.park(rnd, 120.0, broken=0.5)
        took = time.monotonic() - t
        assert failed == [0, 1] and took < 10, (failed, took)
        assert hung.poll() is not None and workers.slots[1].proc is not hung  # replaced by a fresh fork
    finally:
        workers.close()
