"""Merge `bench_train.py` outputs into the chooser's packaged calibration (tenplex/runtime/calibration.json).

python benchmarks/bench_train.py --model tiny --out results/bench_train_tiny.json
python benchmarks/bench_train.py --model small --out results/bench_train_small.json
python benchmarks/calibrate.py results/bench_train_tiny.json results/bench_train_small.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "tenplex" / "runtime" / "calibration.json"


def main(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    doc = {"cores": os.cpu_count(), "source": "benchmarks/bench_train.py", "runs": runs}
    OUT.write_text(json.dumps(doc, indent=1))
    print(f"wrote {OUT} from {len(runs)} runs ({sum(len(r['rows']) for r in runs)} layouts)")
    from tenplex.runtime.chooser import calibration_rows, self_check

    rows = calibration_rows(doc)
    for c in self_check(rows, doc["cores"]):  # leave-one-out
        print(f"{c['model']:>8} on {c['devices']} devices: picks {c['pick']}, {c['ratio']:.2f}x the best")


if __name__ == "__main__":
    main(sys.argv[1:])
