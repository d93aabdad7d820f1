"""`tenplex status RUN_DIR`: a `tenplex run`'s job, layout, step and stores, as a table or JSON."""

from __future__ import annotations

import json
from pathlib import Path

from ..util import human_bytes, print_table


def print_status(run_dir: str, as_json: bool) -> int:
    from ..runtime.rundir import status

    s = status(Path(run_dir))
    if as_json:
        print(json.dumps(s))
        return 0
    rows = [
        [
            st["host"],
            st["url"],
            str(st["pid"]),
            "alive" if st["alive"] else "gone",
            _memory(st),
            ", ".join(map(str, st.get("committed", []))) or "-",
        ]
        for st in s["stores"]
    ]
    of = f"/{s['steps']}" if s["steps"] else ""
    committed = "none" if s["committed_step"] is None else s["committed_step"]
    on = f"{s['layout'] or 'not launched'} on {len(s['devices'])} devices"
    title = f"job {s['job']}: {on}, step {s['step']}{of}, committed {committed}; controller {s['controller']}"
    print_table(title, ["host", "store", "pid", "state", "memory", "committed steps"], rows)
    if not rows:
        print(f"no stores of {run_dir} are running")
    return 0


def _memory(store: dict) -> str:
    if "memory_used" not in store:
        return "-"
    return f"{human_bytes(store['memory_used'])} of {human_bytes(store['memory_limit'])}"
