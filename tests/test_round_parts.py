"""An agent job's downtime in parts (`round_records.downtimes` with the agent's records), on rounds whose
records have known times: a planned change (the old round's final save, the rendezvous after it), one
whose round formed while the save was still under way, and a lost host (no final save)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenplex.runtime.round_records import PARTS, downtimes


def _write(path: Path, recs: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _round(out: Path, n: int, start: float, steps: list[float], saved: tuple[float, float] | None) -> None:
    """Round `n`'s rank-0 records: loaded at `start`, ready 0.4 s later (0.05 s of process group, 0.2 s
    of load, built from start + 0.05), steps ending at `steps`, and the final save (time, seconds)."""
    recs = [
        {"kind": "loaded", "time": start, "step": 0, "seconds": 0.2},
        {
            "kind": "ready",
            "time": start + 0.4,
            "init_at": start - 0.05,
            "process_group_seconds": 0.05,
            "load_seconds": 0.2,
            "world": 2,
            "pids": [1, 2],
            "layout": "dp2-tp1-pp1",
        },
        *({"kind": "step", "time": t, "step": i + 1, "loss": 1.0} for i, t in enumerate(steps)),
    ]
    if saved is not None:
        recs.append({"kind": "saved", "time": saved[0], "step": len(steps), "seconds": saved[1]})
    _write(out / f"round{n}" / "worker.jsonl", recs)


@pytest.mark.parametrize(
    ("saved", "formed", "want"),
    [
        # stop 0.2 (last step 10.0 to the save's start), save 0.1, rendezvous 10.3 -> 10.5, start to init_at
        ((10.3, 0.1), 10.5, {"stop": 0.2, "save": 0.1, "rendezvous": 0.2, "start": 0.05}),
        # the round formed during the save: no rendezvous on the path, start counts from the save's end
        ((10.3, 0.1), 10.25, {"stop": 0.2, "save": 0.1, "rendezvous": 0.0, "start": 0.25}),
        # a lost host: no final save, detection and rendezvous from the last step until the round formed
        (None, 10.5, {"stop": 0.0, "save": 0.0, "rendezvous": 0.5, "start": 0.05}),
    ],
)
def test_a_changes_downtime_is_split_into_its_parts(tmp_path, saved, formed, want) -> None:
    out, agent = tmp_path / "out", tmp_path / "A"
    _round(out, 1, 9.0, [9.8, 10.0], saved)
    _round(out, 2, 10.6, [11.5, 11.7], None)  # ready at 11.0; steps of 0.2 s, the first ended at 11.5
    _write(agent / "agent.jsonl", [{"kind": "round", "time": 8.9, "round": 1},
                                   {"kind": "round", "time": formed, "round": 2}])  # fmt: skip
    [change] = downtimes(out, tmp_path)
    parts = change["parts"]
    assert change["downtime"] == pytest.approx(11.5 - 10.0 - 0.2)
    assert tuple(parts) == PARTS and sum(parts.values()) == pytest.approx(change["downtime"])
    fixed = {"process_group": 0.05, "build": 0.2, "load": 0.2, "first_step": 0.3, "other": 0.0}
    for name, seconds in {**want, **fixed}.items():
        assert parts[name] == pytest.approx(seconds, abs=1e-9), (name, parts)
