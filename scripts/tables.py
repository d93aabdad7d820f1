"""Rewrite the benchmark tables in README.md and docs/*.md from results/*.json, so no figure is typed by hand.

A table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; NAME is one of `TABLES` below,
each placed exactly once. What is between the markers is replaced by a line naming the command and the
results file, then the table; when the file is missing, by "not measured yet: run CMD" (never a stale
figure). Prose around the tables is not touched: say "the table" there, not the figure.

    python scripts/tables.py            # rewrite
    python scripts/tables.py --check    # exit 1, naming them, when tables differ from the JSON (the tests)
    python scripts/tables.py --take-demo runs/demo/summary.json   # after `tenplex demo`: its table too
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)

Cell = Callable[[dict], str]


def num(v: object, digits: int = 3) -> str:
    """A figure as the tables print it: 3 significant digits, thousands separated, '–' for none."""
    if v is None or v == "":
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != 0 and abs(v) >= 10**digits:
            return f"{v:,.0f}"
        return f"{v:.{digits}g}"
    return str(v)


def key(name: str, fmt: Callable[[object], str] = num) -> Cell:
    return lambda row: fmt(row.get(name))


def times(name: str) -> Cell:
    return lambda row: "–" if row.get(name) is None else f"{row[name]:,.0f}×"


def size(name: str) -> Cell:
    """Decimal bytes from a `*_GB` figure, in the largest unit that keeps it readable."""

    def cell(row: dict) -> str:
        gb = row.get(name)
        if gb is None:
            return "–"
        for unit, scale in (("TB", 1e3), ("GB", 1), ("MB", 1e-3)):
            if gb >= scale or unit == "MB":
                return f"{num(gb / scale, 3)} {unit}"
        raise AssertionError

    return cell


def store_result(row: dict) -> str:
    if "GB/s" in row:
        return num(row["GB/s"], 2)
    skip = {"case", "ok", "ratio", "target", "baseline", "baseline GB/s"}
    return "; ".join(f"{k} {num(v)}" for k, v in row.items() if k not in skip)


def store_baseline(row: dict) -> str:
    if "baseline GB/s" in row:
        return f"{row.get('baseline', '')} ({num(row['baseline GB/s'], 3)})"
    return num(row.get("baseline"))


def plain(keys: str) -> tuple[tuple[str, Cell], ...]:
    """Columns headed by their JSON keys (space-separated)."""
    return tuple((k, key(k)) for k in keys.split())


def phase(kind: str, name: str) -> Cell:
    """Seconds of one phase of bench_reconfig's save or load breakdown (the slowest rank's)."""
    return lambda row: num(row.get(f"{kind}_phases", {}).get(name))


def central(name: str) -> Cell:
    """A central-mode figure of bench_reconfig. Rows of runs from before central mode saved into host 0's
    store too (no `central_save_s`) measured only the load through host 0: there `x_central` and
    `central_load_s` are what newer runs call `x_central_load` and `central_local_load_s`."""
    old = {"x_central_load": "x_central", "central_local_load_s": "central_load_s"}

    def cell(row: dict) -> str:
        if "central_save_s" in row:
            return num(row.get(name))
        return num(row.get(old[name])) if name in old else "–"

    return cell


def binary(n: float | None) -> str:
    """Bytes in binary units, as the demo's own report prints them."""
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{num(float(n), 3)} {unit}"
        n /= 1024
    raise AssertionError


def _world(layout: str) -> int:
    sizes = re.findall(r"\d+", layout)
    return int(sizes[0]) * int(sizes[1]) * int(sizes[2]) if len(sizes) == 3 else 0


def demo_kind(r: dict) -> str:
    """The change's kind as the run's table and plot name it (`change`, in summaries since it was added);
    older summaries get the same words from their `failure`/`redeploy` flags and device counts."""
    if r.get("change"):
        return r["change"]
    if r.get("failure") or r.get("redeploy"):
        return "failure" if r.get("failure") else "redeploy"
    a, b = _world(r["from"]), _world(r["to"])
    return f"scale out {a} → {b}" if b > a else f"scale in {a} → {b}" if b < a else "layout change"


def demo_after(doc: dict) -> str:
    """The demo's outcome in one paragraph, from the same summary."""
    out = []
    for rec in doc.get("recoveries", []):
        out.append(f"The failure was recovered from the in-memory snapshot at step {rec['step']} "
                   f"({rec['lost_steps']} steps replayed).")  # fmt: skip
    s = doc.get("static") or {}
    if s:
        verdict = "matches" if s.get("match") else "DOES NOT match"
        params = s.get("max_param_diff"), s.get("param_tolerance")
        out.append(
            f"The loss curve {verdict} a static one-device run of the same {s['steps']} steps: largest "
            f"difference {s['max_loss_diff']:.2g} (tolerance {s['tolerance']:.2g})"
            + (
                f", final parameters within {params[0]:.2g} (tolerance {params[1]:.2g})."
                if None not in params
                else "."
            )
        )
    led = doc.get("ledger") or {}
    if led:
        state = "every one of" if led.get("ok") else "NOT every one of"
        out.append(f"The data ledger shows {state} the {led['samples']} samples consumed exactly once "
                   f"(replayed steps counted as such).")  # fmt: skip
    return ("\n" + " ".join(out) + "\n") if out else ""


@dataclass(frozen=True)
class Table:
    results: str  # the file under results/
    command: str  # what writes it
    columns: tuple[tuple[str, Cell], ...]
    rows: Callable[[dict], bool] = lambda row: True
    records: str = "rows"  # the list in the JSON that holds the rows
    after: Callable[[dict], str] = lambda doc: ""

    def render(self, root: Path) -> str:
        path = root / "results" / self.results
        if not path.exists():
            return f"Not measured yet: run `{self.command}` (writes `results/{self.results}`).\n"
        doc = json.loads(path.read_text())
        when = doc.get("when") or doc.get("meta", {}).get("when")
        machine = doc.get("machine") or doc.get("meta", {}).get("machine")
        cpus = ""
        if isinstance(machine, dict):
            cpus += f", {machine['cpus']} CPUs" if "cpus" in machine else ""
            cpus += f", load average {machine['load']:.1f}" if "load" in machine else ""
        command = doc.get("command") or self.command  # the exact command, where the benchmark records it
        head = f"`{command}` → `results/{self.results}`" + (f" ({when}{cpus})" if when else "") + ":\n\n"
        lines = ["| " + " | ".join(h for h, _ in self.columns) + " |", "|" + "---|" * len(self.columns)]
        rows = [r for r in doc[self.records] if self.rows(r)]
        lines += ["| " + " | ".join(c(r) for _, c in self.columns) + " |" for r in rows]
        return head + "\n".join(lines) + "\n" + self.after(doc)


PLANNER = "python benchmarks/bench_planner.py"
SCALE_OUT = (("model", key("model")), ("devices", lambda r: r["devices"].replace("->", " → ")))
DEMO = "tenplex demo && python scripts/tables.py --take-demo runs/demo/summary.json"
RECONFIG = "python benchmarks/bench_reconfig.py"


def reconfig_after(doc: dict) -> str:
    """Under the loopback table: the slowest case's breakdown and the one- vs two-host save ratios."""
    rows = [r for r in doc["rows"] if r.get("total_s")]
    if not rows:
        return ""
    worst = max(rows, key=lambda r: r["total_s"])
    parts = []
    for kind, phases in (("save", worst.get("save_phases", {})), ("load", worst.get("load_phases", {}))):
        top = sorted(phases.items(), key=lambda kv: -kv[1])[:5]
        parts.append(f"{kind} " + ", ".join(f"{k} {v:.3f}" for k, v in top))
    where = f"{worst['change']} on {worst['hosts']} host(s)"
    out = f"\nSlowest case, {where}, seconds by phase: {'; '.join(parts)}."
    ratio = doc.get("save_1h_over_2h")
    if ratio:
        out += " One host's save / two hosts': " + ", ".join(f"{c} {x:.2f}" for c, x in ratio.items()) + "."
    return out + "\n"


SNAPSHOT = (
    ("snapshot every", key("snapshot_every")),
    ("tokens/s", key("tokens/s", lambda v: f"{v:,.0f}")),
    ("overhead %", key("overhead %", lambda v: num(v, 2))),
    ("median overhead %", key("median overhead %", lambda v: num(v, 2))),
    ("CPU overhead %", key("cpu overhead %", lambda v: num(v, 2))),
    ("snapshots", key("snapshots")),
    ("stall ms (median)", key("stall ms (median)", lambda v: num(v, 1))),
    ("target", key("target")),
    ("ok", key("ok")),
)


def on_device(doc: dict) -> str:
    """Under a table measured on a GPU machine: which device, torch and the copy engine's bandwidth."""
    facts = [f"device: {doc.get('device', 'cuda')}"]
    if "torch" in doc:
        facts.append(f"torch {doc['torch']}")
    if "d2h_gbps" in doc:
        facts.append(f"pinned copies {doc['d2h_gbps']:.1f} GB/s to the host, {doc['h2d_gbps']:.1f} GB/s back")
    if doc.get("bad") == []:
        facts.append("every load equal bit for bit")
    return "\n" + "; ".join(facts) + ".\n"


def times_x(name: str) -> Cell:
    return lambda row: "–" if row.get(name) is None else f"{row[name]:.1f}×"


def agent_after(doc: dict) -> str:
    """Under the agent's table: what was compared, on which hosts."""
    where = (
        f"namespace hosts, {doc['nic_gbps']:g} Gbit/s NICs"
        if doc.get("network") == "netns"
        else "loopback hosts"
    )
    return (f"\nOn {where}, {doc.get('pace_s', 0):g} s steps. Every runtime's downtime from the old round's "
            "last step to the new round's first, less one step (`tenplex run`: one machine's runtime, ranks "
            "started ahead, the same first four changes, its steps unpaced). A lost host's downtime "
            "includes the failure detection, shown apart for the agent: until the next round formed (a host "
            "whose store refuses or is unreachable is taken out of the rendezvous once a collective breaks; "
            "a silent one after 3 s without heartbeats). A host's devices changing while it stays: `tenplex "
            "devices` for the agent; torchrun's agent on that host restarted with another "
            "`--nproc-per-node`.\n")  # fmt: skip


def agent_parts(row: dict) -> str:
    """Where the agent's downtime of a change went (`round_records.round_parts`), parts of 5 ms and more."""
    parts = row.get("agent_parts", {}).items()
    return ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in parts if abs(v) >= 0.005) or "–"


def runtimes_after(doc: dict) -> str:
    """Under the engines' table: wall time, the steps each change landed at, the ledger, the losses."""
    wall, landed = doc["wall_s"], doc["landed"]
    engines = ", ".join(f"{e} {wall[e]:g} s" for e in wall)
    steps = ", ".join(f"{e} {landed[e]}" for e in landed)
    return (f"\nWall time: {engines} (the agents' start-up: an agent and its warm workers per host). Landed "
            f"at steps: {steps} (a failure resumes from the newest snapshot). Data ledger exact: "
            f"{all(doc['ledger_ok'].values())}; largest loss difference from the controller's: "
            f"{doc['max_loss_diff']:.1e}.\n")  # fmt: skip


PEERS = "python benchmarks/bench_peers.py"


def peer(name: str, why: str) -> Cell:
    """A peer's figure, or "not run" where the row records why it could not run (said under the table)."""
    return lambda row: "not run" if row.get(why) else num(row.get(name))


def save_load(system: str) -> Cell:
    return lambda row: f"{num(row.get(f'{system}_save_s'))} + {num(row.get(f'{system}_load_s'))}"


def http_best(row: dict) -> str:
    if row.get("torchft_why"):
        return "not run"
    best = row["http_best_chunks"]
    return f"{num(row[f'http_{best}_s'])} ({best})"


TORCHFT = (
    ("torchft HTTP, 1 request", peer("http_0_s", "torchft_why")),
    ("torchft HTTP, best (chunks)", http_best),
    ("torchft PG (gloo)", peer("pg_s", "torchft_why")),
)


DIRECT = (  # the ratios to tenplex's load(atomic=False)
    ("x_torchft_http_best (atomic=False)", peer("x_torchft_http_best_direct", "torchft_why")),
    ("x_pg (atomic=False)", peer("x_pg_direct", "torchft_why")),
    ("x_floor (atomic=False)", key("x_floor_direct")),
)


def peers_after(doc: dict, recovery: bool) -> str:
    """Under a peer table: why a peer did not run, and which torch ByteCheckpoint ran under."""
    out = []
    for r in (r for r in doc["rows"] if (r["case"] == "recovery") == recovery):
        for why in ("torchft_why", "bytecheckpoint_why"):
            if r.get(why):
                out.append(f"{r['case']}: {why.split('_')[0]} not run: {r[why]}")
        if r.get("bytecheckpoint_torch"):
            warm = r.get("bytecheckpoint_save_s_warmup")
            ran = f"{r['case']}: ByteCheckpoint ran under torch {r['bytecheckpoint_torch']} (its own venv)"
            out.append(ran + (f"; its untimed warm-up save took {warm:.1f} s" if warm else ""))
        if r.get("bad"):
            out.append(f"{r['case']}: WRONG VALUES: {r['bad']}")
    return ("\n" + "\n".join(f"- {line}" for line in out) + "\n") if out else ""


TABLES: dict[str, Table] = {
    "demo": Table(
        "demo.json",
        DEMO,
        (
            ("change", lambda r: f"{r['from']} → {r['to']}"),
            ("kind", demo_kind),
            ("at step", key("step")),
            ("downtime", lambda r: f"{r['downtime']:.1f} s"),
            ("load", lambda r: f"{r['load_seconds']:.2f} s"),
            (
                "moved",
                lambda r: binary(sum(r["bytes"].get(k, 0) for k in ("same_host", "relayed", "cross_host"))),
            ),
            ("cross-host", lambda r: binary(r["bytes"].get("cross_host"))),
            ("lower bound", lambda r: binary(r["plan"].get("cross_host_lower_bound"))),
        ),
        records="reconfigurations",
        after=demo_after,
    ),
    "planner": Table(
        "bench_planner.json",
        PLANNER,
        (
            *SCALE_OUT,
            ("tensors", key("tensors")),
            ("new shards", key("new_shards")),
            ("plan (CPU s)", key("plan_s")),
            ("all-pairs (CPU s)", key("all_pairs_s")),
            ("speed-up", times("speedup_vs_all_pairs")),
        ),
    ),
    "planner-match": Table(
        "bench_planner.json",
        PLANNER,
        (
            *SCALE_OUT,
            ("match (CPU s)", key("assign_s")),
            ("cross-host, numbering", size("cross_host_GB")),
            ("cross-host, matched", size("matched_cross_host_GB")),
            ("ratio", key("matched_vs_numbering", lambda v: num(v, 2))),
        ),
    ),
    "store": Table(
        "bench_store.json",
        "python benchmarks/bench_store.py",
        (
            ("case", key("case")),
            ("GB/s", store_result),
            ("baseline (GB/s)", store_baseline),
            ("ratio", key("ratio", lambda v: num(v, 2))),
            ("target", key("target")),
        ),
    ),
    "reconfig": Table(
        "bench_reconfig.json",
        RECONFIG,
        (
            *plain(
                "change src dst hosts save_s load_s total_s kept_GB same_host_GB relayed_GB cross_GB "
                "cross_lb_GB x_dcp_disk x_dcp_disk_cold x_dcp_shm"
            ),
            ("x_central", central("x_central")),
            ("x_central_load", central("x_central_load")),
            ("x_floor", key("x_floor")),
            ("x_floor_verified", key("x_floor_verified")),
        ),
    ),
    "reconfig-target": Table(
        "bench_reconfig.json",
        RECONFIG,
        plain(
            "change hosts save_s load_s total_s dcp_shm_total_s x_dcp_shm dcp_disk_total_s x_dcp_disk "
            "x_floor x_floor_verified first_total_s x_dcp_shm_first"
        ),
        after=reconfig_after,
    ),
    "reconfig-fixed": Table(
        "bench_reconfig_fixed.json",
        f"{RECONFIG} --size fixed --no-dcp --repeat 3 --out results/bench_reconfig_fixed.json",
        (
            *plain("change hosts save_s load_s total_s"),
            *(
                (f"load {p}", phase("load", p))
                for p in ("describe", "gather", "choose", "plan", "reads", "barrier")
            ),
        ),
    ),
    "small": Table(
        "bench_small.json",
        "python benchmarks/bench_small.py --out results/bench_small.json",
        (
            *plain("state ranks tensors MB"),
            *(
                (f"{label} {system}", key(f"{system}_{part}_s"))
                for part, label in (("save", "save"), ("load_same", "load"), ("load_reshard", "reshard"))
                for system in ("tenplex", "dcp")
            ),
            *plain("x_save x_load_same x_load_reshard x_save_median x_load_same_median"),
        ),
    ),
    "reconfig-baselines": Table(
        "bench_reconfig.json",
        RECONFIG,
        (
            *plain(
                "change hosts dcp_disk_save_s dcp_disk_load_s dcp_disk_load_cold_s dcp_shm_save_s "
                "dcp_shm_load_s central_save_s"
            ),
            ("central_load_s", central("central_load_s")),
            ("central_local_load_s", central("central_local_load_s")),
            ("floor_s", key("floor_s")),
            ("floor_verified_s", key("floor_verified_s")),
        ),
    ),
    "reconfig-dcp": Table(
        "bench_reconfig.json",
        RECONFIG,
        plain("change hosts total_s dcp_tenplex_save_s dcp_tenplex_load_s x_dcp_tenplex dcp_shm_load_s"),
    ),
    "reconfig-netns": Table(
        "bench_reconfig_netns.json",
        f"sudo -E {RECONFIG} --network netns",
        plain(
            "change hosts save_s load_s total_s central_save_s central_load_s central_total_s x_central "
            "x_central_load busiest_GB central_busiest_GB cross_bound_s central_bound_s cross_s "
            "x_cross_bound x_load_bound nic_gbps_measured"
        ),
    ),
    "peers-recovery": Table(
        "bench_peers.json",
        PEERS,
        (
            ("state", size("state_GB")),
            ("tenplex save", key("tenplex_save_s")),
            ("tenplex load", key("tenplex_load_s")),
            ("tenplex load, atomic=False", key("tenplex_direct_load_s")),
            *TORCHFT,
            ("DCP shm save + load", save_load("dcp_shm")),
            ("DCP disk save + load", save_load("dcp_disk")),
            ("floor", key("floor_s")),
            ("x_torchft_http", peer("x_torchft_http", "torchft_why")),
            ("x_torchft_http_best", peer("x_torchft_http_best", "torchft_why")),
            ("x_pg", peer("x_pg", "torchft_why")),
            ("x_dcp_shm", key("x_dcp_shm")),
            ("x_dcp_disk", key("x_dcp_disk")),
            ("x_floor", key("x_floor")),
            *DIRECT,
            ("first: x_torchft_http_best", peer("x_torchft_http_best_first", "torchft_why")),
            ("first: x_pg", peer("x_pg_first", "torchft_why")),
            ("first: x_pg (atomic=False)", peer("x_pg_direct_first", "torchft_why")),
        ),
        rows=lambda r: r["case"] == "recovery",
        after=lambda doc: peers_after(doc, recovery=True),
    ),
    "peers-netns": Table(
        "bench_peers_netns.json",
        f"sudo -E {PEERS} --network netns --nic-gbps 2",
        (
            ("hosts", key("hosts")),
            ("NIC Gbit/s", key("nic_gbps_measured")),
            ("tenplex load", key("tenplex_load_s")),
            ("tenplex load, atomic=False", key("tenplex_direct_load_s")),
            *TORCHFT,
            (
                "DCP → S3 save + load",
                lambda r: f"{num(r.get('dcp_s3_save_s'))} + {num(r.get('dcp_s3_load_s'))}",
            ),
            ("DCP shared /dev/shm load", key("dcp_shm_load_s")),
            ("floor", key("floor_s")),
            ("x_torchft_http_best", peer("x_torchft_http_best", "torchft_why")),
            ("x_pg", peer("x_pg", "torchft_why")),
            ("x_dcp_s3", key("x_dcp_s3")),
            ("x_dcp_shm (shared)", key("x_dcp_shm")),
            ("x_floor", key("x_floor")),
            *DIRECT,
        ),
        after=lambda doc: peers_after(doc, recovery=True),
    ),
    "peers-reshard": Table(
        "bench_peers.json",
        PEERS,
        (
            ("change", lambda r: {"fsdp": "FSDP2 4 → 3", "dp": "dp 2 → 4"}.get(r["case"], r["case"])),
            ("state", size("state_GB")),
            *plain("tenplex_save_s tenplex_load_s dcp_shm_save_s dcp_shm_load_s"),
            ("bytecheckpoint_save_s", peer("bytecheckpoint_save_s", "bytecheckpoint_why")),
            ("bytecheckpoint_load_s", peer("bytecheckpoint_load_s", "bytecheckpoint_why")),
            ("x_dcp_shm", key("x_dcp_shm")),
            ("x_bytecheckpoint", peer("x_bytecheckpoint", "bytecheckpoint_why")),
            ("x_floor", key("x_floor")),
            ("first: x_dcp_shm", key("x_dcp_shm_first")),
            ("first: x_bytecheckpoint", peer("x_bytecheckpoint_first", "bytecheckpoint_why")),
        ),
        rows=lambda r: r["case"] != "recovery",
        after=lambda doc: peers_after(doc, recovery=False),
    ),
    "snapshot": Table("bench_snapshot.json", "python benchmarks/bench_snapshot.py", SNAPSHOT),
    "snapshot-cuda": Table(
        "bench_snapshot_cuda.json",
        "python benchmarks/bench_snapshot.py --device cuda --dp 1 --out results/bench_snapshot_cuda.json",
        SNAPSHOT,
        after=on_device,
    ),
    "megatron": Table(
        "bench_megatron.json",
        "python benchmarks/bench_megatron.py",
        (
            ("change", key("change")),
            ("state (MB)", key("state_MB")),
            *plain("tenplex_save_s tenplex_load_s megatron_save_s megatron_load_s x_megatron"),
            ("first: megatron_save_s", key("first_megatron_save_s")),
            ("first: x_megatron", key("first_x_megatron")),
        ),
        after=lambda doc: (
            "\nWithout the model, on the last tp 2 checkpoint, each a command of its own (the interpreter's "
            f"and torch's start included): `tenplex import megatron` {num(doc.get('import_s'))} s, "
            f"`tenplex export megatron` {num(doc.get('export_s'))} s.\n"
            if "import_s" in doc
            else ""
        ),
    ),
    "cuda": Table(
        "bench_cuda.json",
        "python benchmarks/bench_cuda.py --size 2",
        plain("op tenplex_s dcp_shm_s x_dcp_shm x_floor first_tenplex_s first_dcp_shm_s first_x_dcp_shm"),
        after=on_device,
    ),
    "reconfig-gpu-host": Table(
        "bench_reconfig_gpu_host.json",
        f"{RECONFIG} --out results/bench_reconfig_gpu_host.json",
        plain(
            "change hosts save_s load_s total_s dcp_shm_total_s x_dcp_shm dcp_disk_total_s x_dcp_disk "
            "x_floor first_total_s x_dcp_shm_first"
        ),
        after=reconfig_after,
    ),
    "agent": Table(
        "bench_agent.json",
        "python benchmarks/bench_agent.py",
        (
            ("change", key("change")),
            ("tenplex agent (s)", key("agent_s", lambda v: num(v, 2))),
            ("torchrun (s)", key("torchrun_s", lambda v: num(v, 2))),
            ("torchrun / agent", times_x("x_torchrun")),
            ("tenplex run (s)", key("tenplex_run_s", lambda v: num(v, 2))),
            ("of it: detection (s)", key("detect_s", lambda v: num(v, 2))),
            ("after detection (s)", key("after_detect_s", lambda v: num(v, 2))),
        ),
        after=agent_after,
    ),
    "agent-parts": Table(
        "bench_agent.json",
        "python benchmarks/bench_agent.py",
        (
            ("change", key("change")),
            ("downtime (s)", key("agent_s", lambda v: num(v, 2))),
            ("of it, by part (s)", agent_parts),
        ),
    ),
    "runtimes": Table(
        "bench_runtimes.json",
        "python benchmarks/bench_runtimes.py",
        (
            ("change", key("change")),
            ("at step", key("step")),
            ("controller (s)", key("controller_s", lambda v: num(v, 2))),
            ("agents (s)", key("agents_s", lambda v: num(v, 2))),
            ("agents, --no-ahead (s)", key("agents_no_ahead_s", lambda v: num(v, 2))),
            ("agents, by part (s)", agent_parts),
        ),
        after=runtimes_after,
    ),
    "deepspeed": Table(
        "bench_deepspeed.json",
        "python benchmarks/bench_deepspeed.py",
        (
            ("change", key("change")),
            ("ZeRO", key("stage")),
            ("state (MB)", key("state_MB")),
            ("tenplex save + load (s)", key("tenplex_s")),
            ("DeepSpeed save (s)", key("ds_save_s")),
            ("ds_to_universal (s)", key("ds_convert_s")),
            ("DeepSpeed load (s)", key("ds_load_s")),
            ("DeepSpeed / tenplex", times_x("x_ds")),
            ("first: tenplex (s)", key("first_tenplex_s")),
            ("first: DeepSpeed (s)", key("first_ds_s")),
            ("first: DeepSpeed / tenplex", times_x("first_x_ds")),
            ("bit for bit", key("bitwise")),
        ),
    ),
    "train": Table(
        "bench_train_small.json",
        "python benchmarks/bench_train.py --model small --out results/bench_train_small.json",
        (
            ("layout", key("layout")),
            ("step time (s)", key("step_time_s")),
            ("tokens/s", key("tokens_per_s", lambda v: f"{v:,.0f}")),
            ("vs 1 rank", key("vs_1_rank", lambda v: num(v, 2))),
        ),
    ),
}


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def rewrite(root: Path) -> dict[Path, str]:
    """Every document's text with its tables rendered; raises on unknown, missing or repeated tables."""
    out, seen = {}, {}
    for doc in documents(root):
        if not doc.exists():
            continue
        text = doc.read_text()
        for m in MARKER.finditer(text):
            name = m.group(2)
            if name not in TABLES:
                raise SystemExit(
                    f"{doc.relative_to(root)}: unknown table {name!r} (known: {', '.join(TABLES)})"
                )
            if name in seen:
                raise SystemExit(f"table {name!r} is in both {seen[name]} and {doc.relative_to(root)}")
            seen[name] = doc.relative_to(root)
        out[doc] = MARKER.sub(lambda m: m.group(1) + TABLES[m.group(2)].render(root) + m.group(4), text)
    missing = sorted(set(TABLES) - set(seen))
    if missing:
        raise SystemExit(f"tables placed nowhere (add <!-- table:NAME --> markers): {', '.join(missing)}")
    return out


def take_demo(summary: Path, root: Path) -> Path:
    """`tenplex demo`'s summary.json as results/demo.json: without the losses and the run's local paths."""
    doc = json.loads(summary.read_text())
    keep = {
        k: doc[k]
        for k in ("steps", "reconfigurations", "failures", "recoveries", "ledger", "static")
        if k in doc
    }
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(summary.stat().st_mtime))
    out = root / "results" / "demo.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"benchmark": "demo", "when": when, "machine": {"cpus": os.cpu_count()}, **keep}, indent=1)
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    ap.add_argument("--take-demo", type=Path, metavar="SUMMARY", help="copy a demo's summary.json first")
    ap.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.take_demo:
        print("wrote", take_demo(args.take_demo, args.root).relative_to(args.root))
    stale = []
    for doc, text in rewrite(args.root).items():
        if doc.read_text() != text:
            stale.append(str(doc.relative_to(args.root)))
            if not args.check:
                doc.write_text(text)
    if stale:
        verb = "out of date (run python scripts/tables.py)" if args.check else "rewritten"
        print(f"tables {verb}: {', '.join(stale)}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
