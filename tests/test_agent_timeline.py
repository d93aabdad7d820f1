"""An agent job told in `tenplex run`'s words (`runtime/agent_timeline.py`), on records with known times:
devices in rank order by node, a scale-out, a host lost (its round broke: no final save) and the
recovery from an older step, a redeploy; the summary, the report's table and the ledger read it."""

from __future__ import annotations

import json
from pathlib import Path

from tenplex.runtime.agent_timeline import placements, write_timeline
from tenplex.runtime.record_types import Start
from tenplex.runtime.report import summary
from tenplex.runtime.round_records import round_parts


def _write(path: Path, recs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))


def _round(out: Path, n: int, t: float, start: int, steps: int, layout: str, world: int, saved: bool) -> None:
    """Round `n`'s rank-0 records: loaded at `t` from step `start`, ready, `steps` steps of 0.1 s from
    t + 1, and a final save unless it broke."""
    recs = [
        {"kind": "loaded" if n > 1 else "fresh", "time": t, "step": start, "seconds": 0.1, "bytes": {},
         "plan": {}, "source": "memory"},
        {"kind": "ready", "time": t + 0.5, "init_at": t - 0.1, "process_group_seconds": 0.01,
         "load_seconds": 0.1, "build_seconds": 0.2, "world": world, "pids": [n], "layout": layout},
        *({"kind": "step", "time": t + 1 + 0.1 * i, "step": start + i + 1, "loss": 1.0}
          for i in range(steps)),
    ]  # fmt: skip
    if saved:
        last = t + 1 + 0.1 * (steps - 1)
        recs += [{"kind": "saved", "time": last + 0.05, "step": start + steps, "seconds": 0.02},
                 {"kind": "done", "time": last + 0.06, "step": start + steps}]  # fmt: skip
    _write(out / f"round{n}" / "worker.jsonl", recs)


def _formed(hosts: Path, host: str, n: int, t: float, node: int, devices: list[int]) -> None:
    _write(hosts / host / "agent.jsonl", [{"kind": "round", "time": t, "round": n, "node": node,
                                           "devices": devices}])  # fmt: skip


def test_an_agent_jobs_rounds_become_tenplex_runs_timeline(tmp_path) -> None:
    out = tmp_path
    _round(out, 1, 10.0, 0, 4, "dp2-tp1-pp1", 2, True)
    _formed(tmp_path, "h0", 1, 9.9, 0, [0, 1])
    _round(out, 2, 20.0, 4, 6, "dp2-tp2-pp1", 4, False)  # broke after step 10: h0 lost
    _formed(tmp_path, "h1", 2, 19.9, 0, [0, 1])  # h1 is node 0 of round 2: its devices come first
    _formed(tmp_path, "h0", 2, 19.9, 1, [0, 1])
    _round(out, 3, 30.0, 8, 4, "dp2-tp1-pp1", 2, True)  # the recovery, from the snapshot at 8
    _formed(tmp_path, "h1", 3, 29.9, 0, [0, 1])
    _round(out, 4, 40.0, 12, 3, "dp2-tp1-pp1", 2, True)  # a redeploy onto h2
    _formed(tmp_path, "h2", 4, 39.9, 0, [0, 1])
    assert placements(tmp_path)[2] == ["h1/d0", "h1/d1", "h0/d0", "h0/d1"]
    recs = write_timeline(out, tmp_path, Start("j", 15, [], {}))
    assert [r["kind"] for r in recs if r["kind"] not in ("worker",)] == [
        "start", "launch", "launch", "reconfig", "fail", "recover", "launch", "reconfig", "launch",
        "reconfig", "finish",
    ]  # fmt: skip
    s = summary(out)
    kinds = [(r["change"], r["step"], r["died"], r["lost"]) for r in s["reconfigurations"]]
    assert kinds == [
        ("scale out 2 → 4", 4, None, None),
        ("failure", 8, 10, [2, 3]),
        ("redeploy", 12, None, None),
    ]
    [fail] = s["failures"]
    assert fail["hosts"] == ["h0"] and fail["devices"] == ["h0/d0", "h0/d1"]
    assert [(r["step"], r["lost_steps"]) for r in s["recoveries"]] == [(8, 2)]
    change = s["reconfigurations"][0]
    # the old round's last step (11.3) to the new one's first (21.0), less a step (0.1); the round formed
    # at 19.9, after the save that ended at 11.35
    assert abs(change["downtime"] - 9.6) < 1e-9 and abs(change["parts"]["rendezvous"] - 8.55) < 1e-9
    assert s["steps"] == 15 and sorted(s["losses"]) == list(range(1, 16))
    # written again from the same records: the same timeline, not one appended to the last
    assert write_timeline(out, tmp_path, Start("j", 15, [], {})) == recs
    assert len((out / "timeline.jsonl").read_text().splitlines()) == len(recs)


def test_an_agent_runs_rendezvous_takes_the_most_hosts_the_schedule_has_at_once() -> None:
    """`AgentRun`'s `--nnodes 1:MAX`: the demo's schedule has at most 2 hosts at once (h0 h1, then h2 h3);
    a schedule that grows to 6 devices on 2-device hosts has 3."""
    from tenplex.runtime.agent_run import max_hosts
    from tenplex.runtime.demo import SCHEDULE
    from tenplex.runtime.runconfig import RunConfig
    from tenplex.runtime.schedule import parse_schedule
    from tenplex.train.config import TrainConfig

    def most(events: list[dict]) -> int:
        return max_hosts(RunConfig(TrainConfig(), parse_schedule(events), 10, Path("unused")))

    assert most(SCHEDULE) == 2
    assert (
        most([{"step": 0, "devices": 2}, {"step": 5, "devices": 6}, {"step": 9, "fail_hosts": ["h1"]}]) == 3
    )


def test_a_round_handed_ahead_starts_at_its_turn() -> None:
    """A round handed ahead formed (8.0) and built (init 8.1) while the old one trained; the old round's
    last step ended at 10.0 and its final save at 10.1; the turn came at 10.15 and the ranks were ready at
    10.3 after a 0.1 s load: the downtime is the save, the wait for the turn, what was left to build, the
    load and the first step's excess; nothing of the build before the turn counts."""
    old = {"steps": [{"time": 9.9}, {"time": 10.0}], "saved": {"time": 10.1, "seconds": 0.08}}
    ready = {"time": 10.3, "init_at": 8.1, "process_group_seconds": 0.4, "load_seconds": 0.1,
             "ahead": True, "go_at": 10.15}  # fmt: skip
    new = {"ready": ready, "steps": [{"time": 10.5}, {"time": 10.6}]}
    parts = round_parts(old, new, formed=8.0, step=0.1, gap=0.4)
    want = {"stop": 0.02, "save": 0.08, "rendezvous": 0.0, "start": 0.05, "process_group": 0.0,
            "build": 0.05, "load": 0.1, "first_step": 0.1, "other": 0.0}  # fmt: skip
    assert parts.keys() == want.keys() and all(abs(parts[k] - v) < 1e-9 for k, v in want.items()), parts
