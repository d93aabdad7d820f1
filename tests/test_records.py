"""The runtime's records: one dataclass per kind, written in one place; a misspelt kind or field fails where
it is written, and an optional field left out is absent from the line, as readers expect."""

from __future__ import annotations

import inspect
import json

import pytest

from tenplex.runtime import record_types
from tenplex.runtime.records import Kind, Record, Records, read_records


def _classes() -> list[type[Record]]:
    return [
        c
        for _, c in inspect.getmembers(record_types, inspect.isclass)
        if issubclass(c, Record) and c is not Record
    ]


def test_every_kind_has_a_record_and_every_record_a_kind() -> None:
    kinds = {c.kind for c in _classes()}
    assert all(isinstance(k, Kind) for k in kinds)
    assert kinds == set(Kind), set(Kind) - kinds


def test_a_record_is_written_with_its_kind_and_time_and_read_back(tmp_path) -> None:
    out = Records(tmp_path / "r.jsonl")
    out.write(record_types.Step(3, 1.5), step_time=0.2)  # a kind's open fields: a step's metrics
    out.write(record_types.Fresh(0, "dp2"))  # optional fields left at None are not written
    out.close()
    recs, _ = read_records(tmp_path / "r.jsonl")
    assert recs[0]["kind"] == Kind.STEP and (recs[0]["step"], recs[0]["loss"], recs[0]["step_time"]) == (
        3,
        1.5,
        0.2,
    )
    assert set(recs[1]) == {"kind", "time", "step", "layout"}
    assert json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])["kind"] == "step"


def test_a_wrong_field_or_a_plain_string_fails_where_it_is_written(tmp_path) -> None:
    out = Records(tmp_path / "r.jsonl")
    with pytest.raises(TypeError):
        record_types.Step(step=3, los=1.5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="record_types"):
        out.write("step", step=3)  # type: ignore[arg-type]
    out.close()
    assert (tmp_path / "r.jsonl").read_text() == ""
