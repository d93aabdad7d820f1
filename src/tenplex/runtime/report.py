"""After a run: the loss curve, the reconfigurations, the data ledger, the plot.

The ledger is checked against the dataset PTC itself: every step's global batch must be the one the seeded
order prescribes, so no sample is repeated or skipped within an epoch; steps replayed after a failure are
counted as such (their later run is the one that counts).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..data.sampler import ElasticSampler
from .history import changes, losses, timeline
from .records import Kind, read_records

__all__ = ["ledger", "losses", "plot", "print_report", "recoveries", "summary", "timeline", "write_json"]


def ledger(run_dir: Path) -> dict[str, Any]:
    """Check the samples every step consumed against the seeded order."""
    final, runs, s = _ledger_records(run_dir)
    if s is None:  # a script that keeps no ledger: nothing to check, nothing wrong
        return {"ok": None, "reason": "no ledger: the job recorded no sampler state or samples"}
    sampler = ElasticSampler(s["num_samples"], s["global_batch"], s["seed"])
    bad, seen, epoch_ids = [], set(), set()
    for step in range(1, max(final, default=0) + 1):
        epoch = sampler.state.epoch
        want = sampler.global_batch_ids().tolist()
        got = final.get(step)
        if got != want:
            bad.append(step)
        if got:
            if sampler.state.epoch != epoch:
                epoch_ids = set()
            dup = epoch_ids & set(got)
            if dup:
                bad.append(step)
            epoch_ids |= set(got)
            seen |= set(got)
        sampler.advance()
    return {
        "ok": not bad,
        "steps": len(final),
        "samples": len(seen),
        "mismatched_steps": sorted(set(bad)),
        "replayed_steps": sorted(s for s, n in runs.items() if n > 1),
    }


def _ledger_records(run_dir: Path) -> tuple[dict[int, list[int]], dict[int, int], dict[str, Any] | None]:
    """Per step the samples its last run consumed (dp ranks in order), how often each step ran, and the
    sampler state the job started from (None: it kept no ledger)."""
    phases = [p for p in run_dir.glob("phase*") if p.is_dir()]  # `tenplex run`'s phases, or an agent's rounds
    phases = phases or [p for p in run_dir.glob("round*") if p.is_dir()]
    phases.sort(key=lambda p: int(p.name[5:]))  # phaseN, roundN
    final: dict[int, list[int]] = {}
    runs: dict[int, int] = defaultdict(int)
    sampler_state = None
    for p in phases:
        per_step: dict[int, dict[int, list[int]]] = defaultdict(dict)
        for f in p.glob("ledger-dp*.jsonl"):
            for r in read_records(f)[0]:
                per_step[r["step"]][r["dp"]] = r["ids"]
        for r in read_records(p / "worker.jsonl")[0]:
            if r["kind"] == Kind.READY and sampler_state is None:
                sampler_state = r.get("sampler")
        for step, parts in per_step.items():
            runs[step] += 1
            final[step] = [i for dp in sorted(parts) for i in parts[dp]]
    return final, runs, sampler_state


def recoveries(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recoveries, each from the step its ranks loaded: older than the newest committed snapshot the
    controller counted on (`expected`) when that one could not be read."""
    out = []
    for i, r in enumerate(recs):
        if r["kind"] != Kind.RECOVER:
            continue
        launch = next((x for x in recs[i:] if x["kind"] == Kind.LAUNCH), None)
        phase = launch["phase"] if launch else None
        start = next((x for x in recs[i:] if x["kind"] == Kind.WORKER and x["phase"] == phase
                      and x["event"] in (Kind.LOADED, Kind.FRESH)), None)  # fmt: skip
        if start and start["step"] != r["step"]:
            r = {**r, "step": start["step"], "lost_steps": r["lost_steps"] + r["step"] - start["step"],
                 "expected": r["step"]}  # fmt: skip
        out.append(r)
    return out


def summary(run_dir: Path, static: dict[int, float] | None = None, tolerance: float = 2e-6) -> dict[str, Any]:
    recs = timeline(run_dir)
    elastic = losses(recs)
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "steps": max(elastic, default=0),
        "reconfigurations": changes(recs),
        "failures": [r for r in recs if r["kind"] in (Kind.FAIL, Kind.CRASH)],
        "recoveries": recoveries(recs),
        "skipped_snapshots": [r for r in recs if r["kind"] == Kind.SNAPSHOTS_SKIPPED],
        "ledger": ledger(run_dir),
        "losses": elastic,
    }
    network = [r for r in recs if r["kind"] == Kind.NETWORK]
    if network:  # namespace hosts: each host's address and bytes in/out at the end
        out["hosts"] = network[-1]["hosts"]
    if static is not None:
        common = sorted(set(elastic) & set(static))
        diff = max((abs(elastic[s] - static[s]) for s in common), default=float("nan"))
        out["static"] = {
            "steps": len(common),
            "max_loss_diff": diff,
            "tolerance": tolerance,
            "match": len(common) == len(static) and diff <= tolerance,
        }
    return out


def plot(run_dir: Path, out: Path, static: dict[int, float] | None = None) -> Path:
    """The run's plot (`runtime.plot`, which needs matplotlib), written to `out`."""
    from .plot import plot as draw

    return draw(run_dir, out, static)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def print_breakdown(reconfigs: list[dict]) -> None:
    """Where each reconfiguration's downtime went (`runtime.downtime` names the parts)."""
    from ..util import print_table
    from .downtime import shown_parts

    timed = [r for r in reconfigs if r.get("parts")]
    if not timed:
        return
    names = shown_parts(timed)
    rows = [
        [f"{r['from']} -> {r['to']}", f"{r['downtime']:.2f}"]
        + [f"{r['parts'].get(p, 0.0):.2f}" for p in names]
        + [f"{r['downtime'] - (r['parts']['save'] + r['parts']['load']):.2f}"]
        for r in timed
    ]
    print_table(
        "where the downtime went (seconds; 'beyond': downtime - save - load)",
        ["change", "downtime", *(n.replace("_", " ") for n in names), "beyond"],
        rows,
    )


def print_report(s: dict) -> None:
    """Each reconfiguration (downtime, bytes moved against the lower bound), recoveries, the loss
    comparison with a static run when there is one, and the data ledger."""
    from ..util import human_bytes, print_table

    rows = []
    for r in s["reconfigurations"]:
        moved = sum(v for k, v in r["bytes"].items() if k != "kept")
        rows.append(
            [
                f"{r['from']} -> {r['to']}",
                r["change"],
                str(r["step"]) if r["died"] is None else f"{r['died']} (resumed {r['step']})",
                f"{r['downtime']:.1f} s",
                f"{r['load_seconds'] or 0:.2f} s",
                human_bytes(moved),
                human_bytes(r["bytes"].get("cross_host", 0)),
                human_bytes(r["plan"].get("cross_host_lower_bound", 0)),
                r["source"],
            ]
        )
    print_table(
        "reconfigurations (downtime: last step of the old layout to the first step of the new one)",
        ["change", "kind", "at step", "downtime", "load", "moved", "cross-host", "lower bound", "from"],
        rows,
    )
    print_breakdown(s["reconfigurations"])
    for rec in s["recoveries"]:
        print(
            f"failure recovery: resumed from the snapshot at step {rec['step']}, "
            f"{rec['lost_steps']} steps replayed"
        )
    for sk in s.get("skipped_snapshots", []):
        print(
            f"snapshots of steps {sk['steps']} could not be read (phase {sk['phase']}: {sk['errors'][0]}); "
            f"loaded step {sk['step']} instead"
        )
    if "static" in s:
        st = s["static"]
        verdict = "MATCHES" if st["match"] else "DIFFERS FROM"
        print(
            f"loss curve {verdict} the static run: {st['steps']} steps, largest difference "
            f"{st['max_loss_diff']:.2e} (tolerance {st['tolerance']:.0e})"
            + (
                f"; final parameters differ by at most {st['max_param_diff']:.2e} "
                f"(tolerance {st['param_tolerance']:.0e})"
                if "max_param_diff" in st
                else ""
            )
        )
    led = s["ledger"]
    if led["ok"] is None:
        print(f"data ledger: not checked ({led['reason']})")
        return
    verdict = "every sample exactly once" if led["ok"] else f"MISMATCH at steps {led['mismatched_steps']}"
    print(
        f"data ledger: {verdict} ({led.get('samples')} samples in {led.get('steps')} steps; "
        f"replayed after failures: {led.get('replayed_steps')})"
    )
