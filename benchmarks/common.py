"""Shared benchmark plumbing: results as JSON under results/, a printed table, and the entry point."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path


def entry(main: Callable[[], None]) -> None:
    """Run a benchmark's `main` with SIGTERM taken as Ctrl-C: its `with` and `finally` blocks then remove
    its scratch directories in /dev/shm, stop its stores and kill its ranks (SIGTERM's default action
    ended the process with none of that done)."""
    from tenplex.runtime.exits import sigterm_as_interrupt

    with sigterm_as_interrupt():
        main()


def write_results(name: str, rows: list[dict], meta: dict | None = None, path: str | None = None) -> Path:
    out = Path(path) if path else Path(os.environ.get("TENPLEX_RESULTS", "results")) / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # the load average says how much of the machine other jobs held while this ran (a shared machine)
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()[0]},
        **(meta or {}),
        "rows": rows,
    }
    out.write_text(json.dumps(doc, indent=1))
    refresh_tables(out)
    return out


def refresh_tables(results: Path) -> None:
    """Rewrite the docs' tables (scripts/tables.py) when `results` is this checkout's results/ file, so a
    run and the figures quoted from it are committed together."""
    root = Path(__file__).resolve().parents[1]
    if results.resolve().parent != root / "results" or not (root / "scripts" / "tables.py").exists():
        return
    import runpy

    tables = runpy.run_path(str(root / "scripts" / "tables.py"))
    tables["main"]([])


def print_rows(title: str, rows: list[dict], columns: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*(_fmt(r.get(c)) for c in columns))
    Console().print(table)


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def step_gaps(run_dir: Path) -> list[float]:
    """Per change of a run (its `timeline.jsonl`, the controller's or one from agents): the old phase's last
    step record to the new phase's first, less the new phase's step: one downtime definition for both."""
    from tenplex.runtime.history import timeline
    from tenplex.runtime.round_records import typical_step

    steps: dict[int, list[float]] = {}
    for r in timeline(run_dir):
        if r["kind"] == "worker" and r["event"] == "step":
            steps.setdefault(r["phase"], []).append(r["at"])  # the rank's time (`time`: when it was copied)
    phases = [p for p in steps if len(steps[p]) > 1]
    return [steps[b][0] - steps[a][-1] - typical_step(steps[b]) for a, b in pairwise(phases)]
