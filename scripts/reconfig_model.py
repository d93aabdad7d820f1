"""The reconfiguration model (tenplex.planner.estimate): its measured costs, its check against every
measured point, and the projections in docs/scale.md, all from results/*.json, never typed.

- costs: the fixed parts (per rank: a constant, per tensor saved, per box fetched, reaching another host's
  store) are a least-squares fit to results/bench_reconfig_fixed.json (5 MB of state: the bytes are
  negligible); the per-core rates come from results/bench_reconfig.json (1.2 GB) once those fixed parts
  are taken off: the save rate from all its saves, the load rate from its one-host loads, the cross-host
  cost from its two-host loads; what hosts apart add per rank to a save and a load (collectives and
  authenticated store connections through real links) is the mean of what the namespace-host points of
  results/bench_reconfig_netns.json took beyond the rest of the model;
- check: the model as the development machine ran each measured case (`estimate.emulate`), against the
  measured save + load seconds of every row of those results, with the costs as shipped and, to show how
  much each point moves them, with the costs fitted without it (leave-one-out);
- projections: `tenplex plan --estimate` for the paper's cases and a 70B model.

    python scripts/reconfig_model.py            # write the costs, docs/llama2-70b.json and the tables
    python scripts/reconfig_model.py --check    # exit 1 when any of them differs from what results/ gives
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tenplex.cli.main import build_parser  # noqa: E402
from tenplex.cli.plan_cmd import build_plans, estimates  # noqa: E402
from tenplex.planner import Plan, plan  # noqa: E402
from tenplex.planner.estimate import GB, LINKS, Costs, Demand, Estimate, demand, emulate, slowdowns  # noqa: E402
from tenplex.ptc.gpt import GPTConfig, gpt_ptc  # noqa: E402

RESULTS = ROOT / "results"
COSTS = ROOT / "src" / "tenplex" / "planner" / "reconfig_costs.json"
DOC = ROOT / "docs" / "scale.md"
LLAMA = ROOT / "docs" / "llama2-70b.json"
FIXED, FULL, NETNS_RUN = "bench_reconfig_fixed.json", "bench_reconfig.json", "bench_reconfig_netns.json"
NETNS_FIXED = "bench_reconfig_netns_fixed.json"  # namespace hosts at 5 MB: what each host beyond one adds
SOURCES = tuple(f"results/{name}" for name in (FIXED, FULL, NETNS_RUN, NETNS_FIXED))
SWEEP = "bench_sweep.json"  # checked, not calibrated on: the scale sweep tests the model beyond its inputs
# bench_reconfig_gpu_host.json is not checked: another machine (16 cores), whose own intercepts were never
# measured; these costs are this machine's
CHECKED = (FULL, FIXED, NETNS_RUN, NETNS_FIXED, SWEEP)
BOUND = 0.25  # every checked point within 25% of its measured seconds
# Points the model misses, and why: tests/test_estimate.py asserts every other point is within BOUND.


def _same_change(where: str, there: float, error: str, here: float) -> str:
    """A small state's point that another run of the same change contradicts: on this VM two runs a quarter
    of an hour apart differ by more than the model's 25% at 5 MB."""
    return (
        f"the same change took {there} s in {where} ({error} from the model there) and {here} s here, the "
        "runs a quarter of an hour apart: at 5 MB this VM's run-to-run spread is wider than 25%"
    )


MISSES = {
    (NETNS_FIXED, "dp", 4): "0.179 s, faster than the same change on 2 hosts in the same run (0.277 s): the "
    "best of its 2 repetitions on a shared VM; the model is within 25% of the run's other 5 points",
    (SWEEP, "4 ranks, 2 loopback hosts, 0.005 GB", 2): _same_change(FIXED, 0.246, "+3%", 0.202),
    (SWEEP, "4 ranks, 2 netns hosts, 0.005 GB", 2): _same_change(NETNS_FIXED, 0.291, "-4%", 0.195),
    (SWEEP, "8 ranks, 8 netns hosts, 0.005 GB", 8): _same_change(NETNS_FIXED, 0.701, "-13%", 0.468),
    (SWEEP, "4 ranks, 2 loopback hosts, 2.4 GB", 2): "grows faster than linearly from 1.2 GB: the second "
    "1.2 GB cost the load 0.60 s a GB and the save 0.19 (0.37 and 0.13 from 0.6 to 1.2 GB), with 15 GB of "
    "this machine's 24 GB taken at the peak (6.4 bytes a byte of state); the model's rates are linear",
}
MARKER = re.compile(r"(<!-- estimate:([\w-]+) -->\n)(.*?)(<!-- /estimate:\2 -->)", re.S)


def bench_plan(doc: dict, row: dict) -> Plan:
    """The plan of a measured case: its model and layouts, rank r on host r * hosts // world as
    benchmarks/bench_reconfig.py places them (4 ranks, or one per namespace host beyond 4) and
    benchmarks/bench_sweep.py (its rows name their model and world)."""
    cfg = GPTConfig(**(row.get("model") or doc["model"]))
    hosts = row["hosts"]
    world = row.get("world") or (max(4, hosts) if doc.get("network") == "netns" else 4)
    # the sweep's 5 MB model has 4 heads and 16 ranks split its tensors 16 ways, as the worker does (no
    # tensor's shape depends on the heads): the planner's check that tp divides the heads is moot here
    cfg = replace(cfg, heads=max(cfg.heads, world))

    def ptc(layout: str):
        dp, tp, pp = map(int, layout.split("x"))
        devices = [(f"h{r * hosts // world}/d{r}", f"h{r * hosts // world}") for r in range(dp * tp * pp)]
        return gpt_ptc(cfg, dp, tp, pp, devices=devices)

    return plan(ptc(row["src"]), ptc(row["dst"]))


def load_results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


@dataclass(frozen=True)
class Case:
    """One measured row: where it came from, what the planner says it asks of each host, what it took."""

    file: str
    row: dict
    demand: Demand
    netns: bool
    link_GBps: float | None  # a namespace host's shaped link, as that run measured it
    memcpy_GBps: float  # the machine's memcpy in that run
    interp_per_s: float | None  # the interpreter's speed in that run (None: not measured)

    @property
    def key(self) -> tuple[str, str, int]:
        return (
            self.file,
            self.row.get("name") or self.row["change"],
            self.row["hosts"],
        )  # a sweep names its points

    def emulate(self, costs: Costs) -> Estimate:
        return emulate(self.demand, costs, self.link_GBps, self.memcpy_GBps, self.netns, self.interp_per_s)


def cases() -> list[Case]:
    out = []
    for name in CHECKED:
        if not (RESULTS / name).exists():
            continue
        doc = load_results(name)
        for row in doc["rows"]:
            if row.get("status", "ok") != "ok":  # a sweep's failed or skipped point: no seconds to check
                continue
            link = row["nic_gbps_measured"] / 8 if "nic_gbps_measured" in row else None
            d, netns = demand(bench_plan(doc, row)), row.get("network", doc.get("network")) == "netns"
            out.append(Case(name, row, d, netns, link, *_speeds(doc)))
    return out


def _speeds(doc: dict) -> tuple[float, float | None]:
    """A run's memcpy and interpreter speed: the better of the probes before and after its cases (each
    probe is one moment of a shared VM; the memcpy's swung from 20 to 33 GB/s within minutes, and a probe
    that overlapped the teardown of 16 namespace hosts read half the interpreter's speed)."""
    memcpy = max(doc["memcpy_GBps"], doc.get("memcpy_GBps_after", 0.0))
    interp = [doc[k] for k in ("interp_per_s", "interp_per_s_after") if k in doc]
    return memcpy, max(interp) if interp else None


def contention(ranks: int, cores: int) -> float:
    return max(1.0, ranks / cores)


def calibrate(measured: list[Case], cores: int) -> Costs:
    """Intercepts from the 5 MB run, per-core rates from the 1.2 GB run (both loopback hosts), then what
    namespace hosts add: per host beyond the first to a save and a load, from the namespace run at 5 MB,
    and per GB crossing their links, from the one at 0.3 GB. Each run's seconds are first brought to the
    1.2 GB run's speed: the fixed parts by its interpreter's, the byte parts by its memcpy's."""
    fixed = [c for c in measured if c.file == FIXED]
    full = [c for c in measured if c.file == FULL]
    ref, ref_interp = full[0].memcpy_GBps, full[0].interp_per_s or 0.0

    def slow_fixed(c: Case) -> float:  # as `emulate` scales the fixed parts of c's run
        return slowdowns(ref, ref_interp, c.memcpy_GBps, c.interp_per_s)[1]

    def fit(kind: str, features) -> np.ndarray:
        x = [features(c.demand) for c in fixed]
        y = [c.row[f"{kind}_s"] / contention(c.demand.ranks[kind == "load"], cores) / slow_fixed(c)
             for c in fixed]  # fmt: skip
        return np.linalg.lstsq(np.array(x, dtype=float), np.array(y), rcond=None)[0]

    save = fit("save", lambda d: [1, d.tensors_saved])
    load = fit("load", lambda d: [1, d.fetches, d.remote])
    inf = float("inf")  # no byte part yet: what `emulate` gives is the fixed part alone
    costs = Costs(cores, *map(float, (*save, *load)), inf, inf, inf, ref, 0.0, 0.0, ref_interp, 0.0, SOURCES)

    def byte_part(cs: list[Case], kind: str) -> float:  # their seconds less the fixed costs
        return sum(c.row[f"{kind}_s"] - getattr(c.emulate(costs), f"{kind}_s") for c in cs)

    def rate(nbytes: float, seconds: float) -> float:
        return nbytes / seconds / cores / GB

    save_rate = rate(sum(c.demand.total("saved") for c in full), byte_part(full, "save"))
    one, two = [c for c in full if not c.demand.remote], [c for c in full if c.demand.remote]
    load_rate = rate(sum(c.demand.total("read") for c in one), byte_part(one, "load"))
    local = sum(c.demand.total("read") for c in two) / (cores * load_rate * GB)
    net_rate = rate(sum(c.demand.total("ingress") for c in two), byte_part(two, "load") - local)
    costs = replace(costs, save_core_GBps=save_rate, load_core_GBps=load_rate, net_core_GBps=net_rate)
    return _apart(costs, measured, slow_fixed)


def _apart(costs: Costs, measured: list[Case], slow_fixed) -> Costs:
    """What namespace hosts add beyond loopback's model, each part from the run where it dominates (least
    squares over every point of it): per host beyond the first, a save's and a load's seconds from the
    5 MB run; then per GB crossing their links, a load's seconds on one core, from the 0.3 GB run. Per host,
    not per rank: fitted per rank on the 0.3 GB run alone it was four times too large at 5 MB."""
    small, large = ([c for c in measured if c.file == f] for f in (NETNS_FIXED, NETNS_RUN))
    if not small or not large:
        return costs

    def fit(cs: list[Case], kind: str, feature, now: Costs) -> float:
        x = [feature(c) for c in cs]
        y = [c.row[f"{kind}_s"] - getattr(c.emulate(now), f"{kind}_s") for c in cs]
        return float(np.dot(x, y) / np.dot(x, x))

    def others(c: Case) -> float:  # hosts beyond the first, as `emulate` scales them in c's run
        return (c.demand.hosts - 1) * slow_fixed(c)

    costs = replace(costs, ns_save_host_s=fit(small, "save", others, costs),
                    ns_load_host_s=fit(small, "load", others, costs))  # fmt: skip
    per_gb = fit(large, "load", lambda c: c.demand.total("ingress") / GB / costs.cores
                 * slowdowns(costs.memcpy_GBps, costs.interp_per_s, c.memcpy_GBps, c.interp_per_s)[0],
                 costs)  # fmt: skip
    return replace(costs, ns_s_per_GB=per_gb)


def points() -> list[dict]:
    """Every measured case against the model's emulation of it: with the costs fitted on every case (the
    model as shipped), and with the costs fitted without that case (leave-one-out)."""
    measured = cases()
    cores = load_results(FULL)["machine"]["cpus"]
    shipped = calibrate(measured, cores)
    out = []
    for case in measured:
        e = case.emulate(shipped)
        left_out = case.emulate(calibrate([c for c in measured if c is not case], cores)).total_s
        took = case.row["save_s"] + case.row["load_s"]
        out.append({
            "file": case.file, "change": case.row["change"], "hosts": case.row["hosts"],
            "layouts": f"{case.row['src']} -> {case.row['dst']}", "state_GB": case.row["state_GB"],
            "measured_s": took, "predicted_s": e.total_s, "error": e.total_s / took - 1,
            "left_out_s": left_out, "left_out_error": left_out / took - 1,
            "decided_by": e.bottleneck, "miss": MISSES.get(case.key), "name": case.row.get("name"),
        })  # fmt: skip
    return out


def llama2_70b() -> dict:
    """Llama-2-70B's tensors as a model description (docs/cli.md's format): GQA attention with 8 KV heads,
    SwiGLU MLP, RMSNorm, untied embeddings: 68.98e9 parameters."""
    h, kv, f, vocab = 8192, 1024, 28672, 32000
    tensors = [{"name": "embed.weight", "shape": [vocab, h], "tp_dim": 0, "layer": "first"}]
    for i in range(80):
        b = f"layers.{i}."
        tensors += [
            {"name": b + "attn_norm.weight", "shape": [h], "layer": i},
            *({"name": b + f"attn.{n}.weight", "shape": [rows, h], "tp_dim": 0, "layer": i}
              for n, rows in (("q", h), ("k", kv), ("v", kv))),
            {"name": b + "attn.o.weight", "shape": [h, h], "tp_dim": 1, "layer": i},
            {"name": b + "mlp_norm.weight", "shape": [h], "layer": i},
            *({"name": b + f"mlp.{n}.weight", "shape": [f, h], "tp_dim": 0, "layer": i}
              for n in ("gate", "up")),
            {"name": b + "mlp.down.weight", "shape": [h, f], "tp_dim": 1, "layer": i},
        ]  # fmt: skip
    tensors += [
        {"name": "norm.weight", "shape": [h], "layer": "last"},
        {"name": "lm_head.weight", "shape": [vocab, h], "tp_dim": 0, "layer": "last"},
    ]
    return {
        "format": "tenplex.model",
        "layers": 80,
        "heads": 64,
        "hidden": h,
        "seq": 4096,
        "tensors": tensors,
    }


def description_text(model: dict) -> str:
    """A model description as JSON with one tensor a line: short enough to read and to diff."""
    head = {k: v for k, v in model.items() if k != "tensors"}
    lines = ",\n".join(f"  {json.dumps(t)}" for t in model["tensors"])
    return json.dumps(head)[:-1] + ', "tensors": [\n' + lines + "\n]}\n"


# (case, the paper's figure or the anchor, `tenplex plan` arguments)
XL, B27, B67, L70 = "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "docs/llama2-70b.json"
PAPER = "--devices-per-host 4"  # the on-premise cluster: 4 hosts of 4 GPUs
CASES = [
    *(
        (f"{m} {what}", "Fig. 14", f"--model {m} --from dp=1,tp=4,pp=2 --to {to} {PAPER}")
        for m in (XL, B27, B67)
        for what, to in (("D 8->16", "dp=2,tp=4,pp=2"), ("M 8->16", "dp=1,tp=8,pp=2"),
                         ("P 8->16", "dp=1,tp=4,pp=4"))
    ),
    *(
        (f"{m} redeploy 8->8", "Fig. 10",
         f"--model {m} --from dp=1,tp=4,pp=2 --to dp=1,tp=4,pp=2 --redeploy {PAPER}")
        for m in (XL, B27, B67)
    ),
    (f"{B27} 4 GPUs fail 16->8", "Fig. 11", f"--model {B27} --from dp=2,tp=4,pp=2 --to dp=1,tp=4,pp=2 "
     f"--lost-hosts 0 {PAPER}"),
    ("70B dp 64->128", "DynaTrain < 2 s", f"--model {L70} --from dp=1,tp=8,pp=8 --to dp=2,tp=8,pp=8"),
    ("70B pp 64->128", "DynaTrain < 2 s", f"--model {L70} --from dp=1,tp=8,pp=8 --to dp=1,tp=8,pp=16"),
    ("70B host fails 128->64", "DynaTrain < 2 s", f"--model {L70} --from dp=2,tp=8,pp=8 --to dp=1,tp=8,pp=8 "
     "--lost-hosts 0"),
]  # fmt: skip
COLUMNS = ("100g", "400g", "nvlink")


def projections(costs: Costs) -> list[dict]:
    """Each case under each link, as `tenplex plan --estimate` computes it."""
    out = []
    for case, anchor, argv in CASES:
        args = build_parser().parse_args(
            ["plan", *argv.split(), "--estimate", "--bandwidth", ",".join(COLUMNS)]
        )
        _, p, _, _ = build_plans(args)
        projected = estimates(p, args, costs)
        out.append({"case": case, "anchor": anchor, "argv": argv, "state_GB": p.stats.total_state / GB,
                    "cross_GB": p.stats.cross_host / GB, "estimates": projected})  # fmt: skip
    return out


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def render_checks(costs: Costs) -> str:
    rows = [
        [p["file"], p["change"], p["layouts"], str(p["hosts"]), f"{p['state_GB']:.2f}",
         f"{p['measured_s']:.3f}", f"{p['predicted_s']:.3f}", f"{p['error']:+.0%}",
         f"{p['left_out_s']:.3f} ({p['left_out_error']:+.0%})", p["decided_by"], p["miss"] or "within 25%"]
        for p in points()
    ]  # fmt: skip
    c = costs
    said = (
        f"Costs (`python scripts/reconfig_model.py`, from {', '.join(c.sources)}), per rank on a core of its "
        f"own: a save {c.save_fixed_s * 1e3:.1f} ms + {c.save_per_tensor_s * 1e6:.0f} µs per tensor, a load "
        f"{c.load_fixed_s * 1e3:.1f} ms + {c.load_per_fetch_s * 1e6:.0f} µs per box + "
        f"{c.load_remote_s * 1e3:.1f} ms when it reaches another host's store; one core saves "
        f"{c.save_core_GBps:.2f} GB/s, loads {c.load_core_GBps:.2f} GB/s, and spends "
        f"{1 / c.net_core_GBps:.2f} s per GB crossing hosts (both ends). Namespace hosts add "
        f"{c.ns_save_host_s * 1e3:.0f} ms a save and {c.ns_load_host_s * 1e3:.0f} ms a load per host beyond "
        f"the first, and {c.ns_s_per_GB:.2f} s per GB crossing their links on one core (one machine's "
        "kernel and cores do every emulated host's networking: counted in this check, not in the "
        "projections). Each run's fixed parts "
        f"scale by its interpreter's speed against {c.interp_per_s:.0f} rounds/s, its byte parts by its "
        f"memcpy against {c.memcpy_GBps:.1f} GB/s. `model s`: with these costs; "
        "`model s without this point`: with the costs fitted on the other points (leave-one-out).\n\n"
    )
    head = ["results", "change", "layouts", "hosts", "state GB", "measured s", "model s", "error",
            "model s without this point", "decided by", "check"]  # fmt: skip
    return said + table(head, rows)


def render_projections(costs: Costs) -> str:
    rows = []
    projected = projections(costs)
    for p in projected:
        cells = [f"{e.total_s:.2f} s ({e.bottleneck})" for e in p["estimates"].values()]
        rows.append([p["case"], p["anchor"], f"{p['state_GB']:.0f}", f"{p['cross_GB']:.0f}", *cells,
                     f"`tenplex plan {p['argv']} --estimate`"])  # fmt: skip
    shared = next(iter(projected[0]["estimates"].values())).assumptions[1:-1]  # the last is the case's
    said = "".join(f"- {a}\n" for a in [*(LINKS[n].describe() for n in COLUMNS), *shared]) + "\n"
    head = ["case", "compare", "state GB", "cross-host GB", *(LINKS[n].name for n in COLUMNS), "command"]
    return said + table(head, rows)


def sweep_cells(r: dict, model: dict[str, dict]) -> list[str]:
    """A row of the sweep's table: what the point measured and what the model predicted for it."""
    if r["status"] != "ok":
        return [r["name"], "/".join(r["series"]), *["–"] * 10, f"{r['status']}: {r['why']}"]
    m, dcp = model[r["name"]], r.get("dcp_shm_total_s")
    check = m["miss"] or ("within 25%" if abs(m["error"]) <= BOUND else "MISS")
    return [
        r["name"], "/".join(r["series"]), f"{r['state_GB']:.3g}", f"{r['save_s']:.3f}", f"{r['load_s']:.3f}",
        f"{r['first_save_s']:.3f} + {r['first_load_s']:.3f}", f"{r['GBps']:.3g}",
        "–" if dcp is None else f"{dcp:.3f}", f"{r['x_floor']:.3g}", f"{r['peak_GB'] / r['state_GB']:.3g}",
        f"{r['store_held_per_byte']:.2f}", f"{m['predicted_s']:.3f} ({m['error']:+.0%})", check,
    ]  # fmt: skip


def fit_text(f: dict) -> str:
    def one(k: str) -> str:
        return f"{f[k]['intercept_s'] * 1e3:.0f} ms + {f[k]['slope_s_per_GB']:.3f} s/GB"

    return (f"save {one('save')}, load {one('load')} (first run: save {one('first_save')}, "
            f"load {one('first_load')})")  # fmt: skip


SWEEP_COLUMNS = ["point", "series", "state GB", "save s", "load s", "first run s (save + load)", "GB/s",
                 "DCP shm s", "x_floor", "peak GB per GB", "store bytes per byte", "model s",
                 "check"]  # fmt: skip


def render_sweep() -> str:
    """The scale sweep's table (results/bench_sweep.json): each point against the model, fits and knees."""
    if not (RESULTS / SWEEP).exists():
        return f"Not measured yet: run `python benchmarks/bench_sweep.py` (writes `results/{SWEEP}`).\n"
    doc = load_results(SWEEP)
    model = {p["name"]: p for p in points() if p["file"] == SWEEP}
    m = doc["machine"]
    head = (f"`{doc['command']}` → `results/{SWEEP}` ({doc['when']}, {m['cpus']} CPUs, load average "
            f"{m['load']:.1f}; memcpy {doc['memcpy_GBps']:.1f} GB/s{_interp(doc)}):\n\n")  # fmt: skip
    notes = [f"- fit, {name}: {fit_text(f)}" for name, f in doc["fits"].items()]
    notes += [f"- knee: {k['point']}: {k['why']}" for k in doc["knees"]] or ["- no knee"]
    if doc.get("peak_per_GB"):
        notes.append(f"- memory: the peak was at most {doc['peak_per_GB']:.2f} bytes a byte of state")
    budget = doc["budget_min"]
    notes.append(
        f"- stopped by the budget ({budget:g} min)"
        if doc["stopped_by_budget"]
        else f"- within {budget:g} min"
    )
    # a ladder that stopped at the first size that did not fit: that row, and how many larger ones went too
    rs = doc["rows"]
    shown = [r for i, r in enumerate(rs) if r["status"] != "skipped" or rs[i - 1]["status"] != "skipped"]
    rows = [sweep_cells(r, model) for r in shown]
    if len(shown) < len(rs):
        notes.append(f"- {len(rs) - len(shown)} larger sizes skipped for the same reason")
    return head + table(SWEEP_COLUMNS, rows) + "\n" + "\n".join(notes) + "\n"


def _interp(doc: dict) -> str:
    speeds = [doc[k] for k in ("interp_per_s", "interp_per_s_after") if k in doc]
    return f", interpreter {'-'.join(f'{x:.0f}' for x in speeds)} rounds/s" if speeds else ""


def outputs() -> dict[Path, str]:
    costs = calibrate(cases(), load_results(FULL)["machine"]["cpus"])
    doc = DOC.read_text()
    blocks = {
        "checks": render_checks(costs),
        "projections": render_projections(costs),
        "sweep": render_sweep(),
    }
    found = {m.group(2) for m in MARKER.finditer(doc)}
    if found != set(blocks):
        raise SystemExit(f"{DOC.relative_to(ROOT)}: markers {sorted(found)}, expected {sorted(blocks)}")
    return {
        COSTS: json.dumps(costs.to_json(), indent=1) + "\n",
        LLAMA: description_text(llama2_70b()),
        DOC: MARKER.sub(lambda m: m.group(1) + blocks[m.group(2)] + m.group(4), doc),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a written file differs")
    args = ap.parse_args(argv)
    if not LLAMA.exists():  # the projections read it
        LLAMA.write_text(description_text(llama2_70b()))
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date (run python scripts/reconfig_model.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
