"""The plot of a run, from its timeline: the devices and layout of each phase against the step, the loss
(and, beside a static run, the difference on its own axis), and each change's downtime by its parts.

Every change is marked where it happened, in the words of `history.KINDS`; a failure at the step its ranks
died (the recovery's replayed steps run again after it). Labels that would overlap are moved apart.
matplotlib is an optional dependency (`tenplex[plot]`): it is imported only when a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .downtime import shown_parts
from .history import changes, losses, timeline
from .records import Kind

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Annotation

COLORS = {"scale out": "tab:green", "scale in": "tab:orange", "layout change": "tab:blue",
          "redeploy": "tab:purple", "failure": "tab:red"}  # fmt: skip
PART_COLORS = {"stop": "#c49c94", "save": "#1f77b4", "go": "#aec7e8", "exit": "#7f7f7f", "persist": "#17becf",
               "start": "#bcbd22", "process_group": "#ff7f0e", "build": "#ffbb78", "load": "#2ca02c",
               "first_step": "#98df8a", "other": "#8c564b", "rendezvous": "#9467bd"}  # fmt: skip
STYLE = {False: ":", True: "--"}  # a change's line; dashed: a failure, at the step its ranks died
LABEL = {"fontsize": 8, "textcoords": "offset points", "ha": "center"}


def phases(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each launched phase: its layout (as its ranks name it), devices, hosts, and the steps it ran, from
    the step it loaded (or the launch's) to its last step (for a failed phase, the step its ranks died)."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["kind"] == Kind.LAUNCH:
            hosts, step = r.get("hosts", []), r["step"]
            out[r["phase"]] = {"layout": r["layout"], "devices": len(r["devices"]), "hosts": hosts,
                               "start": step, "end": step}  # fmt: skip
        elif r["kind"] == Kind.WORKER and r.get("phase") in out:
            p = out[r["phase"]]
            if r["event"] in (Kind.LOADED, Kind.FRESH):
                p["start"] = p["end"] = r["step"]
            elif r["event"] == Kind.STEP:
                p["end"] = max(p["end"], r["step"])
            elif r["event"] == Kind.READY and r.get("layout"):
                p["layout"] = r["layout"]
    return [out[i] for i in sorted(out)]


def at(change: dict[str, Any]) -> int:
    """Where a change shows on the step axis: the step it took effect, or the step a failure hit."""
    return change["died"] if change["died"] is not None else change["step"]


def _devices_panel(ax: Axes, runs: list[dict[str, Any]], changed: list[dict[str, Any]]) -> list[Annotation]:
    """One bar per phase at its device count, cut at every change; its layout above it, its hosts below;
    each change's kind above all, at its step."""
    from matplotlib.ticker import MaxNLocator

    labels = []
    for i, p in enumerate(runs):
        color = "#4c72b0" if i % 2 == 0 else "#55a868"  # neighbours at one height stay apart
        ax.hlines(p["devices"], p["start"] + 0.15, p["end"] - 0.15, lw=6, color=color)
        mid = (p["start"] + p["end"]) / 2
        labels.append(ax.annotate(p["layout"], (mid, p["devices"]), xytext=(0, 7), **LABEL))
        labels.append(ax.annotate(" ".join(p["hosts"]), (mid, p["devices"]), xytext=(0, -14), color="0.35",
                                  **LABEL))  # fmt: skip
    top = max((p["devices"] for p in runs), default=1)
    for c in changed:
        color = COLORS[c["change_kind"]]
        ax.axvline(at(c), color=color, ls=STYLE[c["died"] is not None], lw=1.2)
        labels.append(ax.annotate(c["change"], (at(c), top + 1.2), xytext=(0, 0), color=color, **LABEL))
        labels[-1].set_weight("bold")
        if c["died"] is not None:
            labels.append(_death(ax, c))
    ax.set_ylim(0, top + 2.2)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("devices")
    ax.set_title("devices and layout of each phase (hosts below each bar; ✕ where ranks died)")
    return labels


def _death(ax: Axes, c: dict[str, Any]) -> Annotation:
    """A cross where the ranks died, an arrow to where the recovery resumed."""
    red, (old, new) = COLORS["failure"], c["devices"]
    ax.plot([c["died"]], [old], "x", color=red, ms=10, mew=2.5)
    ax.annotate("", (c["step"], new), (c["died"], old), arrowprops={"arrowstyle": "->", "color": red})
    lost = c["lost"] or []
    who = ("rank " if len(lost) == 1 else "ranks ") + ", ".join(map(str, lost))
    text = f"{who} died at step {c['died']},\nresumed from step {c['step']}"
    style = {"ha": "left", "va": "center", "fontsize": 7, "color": red,
             "bbox": {"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1}}  # fmt: skip
    return ax.annotate(text, (c["died"], old), xytext=(10, 0), textcoords="offset points", **style)


def _loss_panel(ax: Axes, elastic: dict[int, float], static: dict[int, float] | None,
                changed: list[dict[str, Any]]) -> None:  # fmt: skip
    if static:
        ax.plot(list(static), list(static.values()), color="0.6", lw=4, alpha=0.5, label="static run")
    ax.plot(list(elastic), list(elastic.values()), color="#4c72b0", lw=1.3, label="elastic run")
    for c in changed:
        ax.axvline(at(c), color=COLORS[c["change_kind"]], ls=STYLE[c["died"] is not None], lw=1)
        if c["died"] is not None and c["died"] > c["step"]:
            ax.axvspan(c["step"], c["died"], color=COLORS["failure"], alpha=0.08, lw=0)
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("loss per step (shaded: steps replayed after the failure)")


def _diff_panel(ax: Axes, elastic: dict[int, float], static: dict[int, float]) -> None:
    common = sorted(set(elastic) & set(static))
    diff = [elastic[s] - static[s] for s in common]
    ax.axhline(0, color="0.6", lw=0.8)
    ax.plot(common, diff, ".-", color="#c44e52", lw=0.8, ms=3)
    largest = max((abs(d) for d in diff), default=0.0)
    ax.set_ylabel("elastic − static")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.set_title(f"loss difference, elastic − static (largest |difference| {largest:.1e})")


def _downtime_panel(ax: Axes, changed: list[dict[str, Any]]) -> None:
    """Each change's downtime stacked by its parts (`runtime.downtime`), the bar named by its kind."""
    ax.set_title("downtime of each change, by part (last step of the old layout to the first of the new)")
    ax.set_ylabel("downtime (s)")
    if not changed:
        ax.text(0.5, 0.5, "no changes", transform=ax.transAxes, ha="center", va="center")
        return
    names = [n for n in shown_parts([c for c in changed if c.get("parts")]) if n != "other"] + ["other"]
    xs = range(len(changed))
    bottom = [0.0] * len(changed)
    for name in names:
        heights = [part(c, name, names) for c in changed]
        ax.bar(xs, heights, 0.6, bottom=bottom, color=PART_COLORS[name], label=name.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, c in zip(xs, changed, strict=True):
        ax.annotate(f"{c['downtime']:.2f} s", (x, c["downtime"]), xytext=(0, 3), **LABEL)
    when = [f"died {c['died']}, resumed {c['step']}" if c["died"] is not None else f"step {c['step']}"
            for c in changed]  # fmt: skip
    ax.set_xticks(list(xs), [f"{c['change']}\n{c['from']} → {c['to']}\n{w}" for c, w in zip(changed, when)])
    for tick, c in zip(ax.get_xticklabels(), changed, strict=True):
        tick.set(color=COLORS[c["change_kind"]], fontsize=7.5)
    ax.set_ylim(0, max(c["downtime"] for c in changed) * 1.2)
    handles, texts = ax.get_legend_handles_labels()  # top of the stack first, as the bars read
    ax.legend(handles[::-1], texts[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              title="where it went")  # fmt: skip


def part(change: dict[str, Any], name: str, names: list[str]) -> float:
    """A change's seconds in part `name`; `other` takes the parts too small to be drawn, so a bar's parts
    add up to its downtime."""
    parts = change.get("parts") or {}
    if name != "other":
        return parts.get(name, 0.0)
    return change["downtime"] - sum(parts.get(n, 0.0) for n in names if n != "other")


def unclutter(fig: Figure, labels: list[Annotation]) -> None:
    """Move each label up, left to right, past the labels before it that it would overlap."""
    renderer = fig.canvas.get_renderer()
    placed = []
    for label in sorted(labels, key=lambda t: t.get_window_extent(renderer).x0):
        for _ in range(len(placed) + 1):
            box = label.get_window_extent(renderer)
            hit = next((p for p in placed if box.overlaps(p)), None)
            if hit is None:
                break
            dx, dy = label.xyann
            label.xyann = (dx, dy + (hit.y1 - box.y0 + 2) * 72 / fig.dpi)
        placed.append(label.get_window_extent(renderer))


def figure(run_dir: Path, static: dict[int, float] | None = None) -> Figure:
    """The run's figure (not saved): devices, loss, the difference from `static` when given, downtimes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    recs = timeline(run_dir)
    elastic, changed = losses(recs), changes(recs)
    rows = [2.2, 2.6] + ([1.3] if static else []) + [2.6]
    fig = Figure(figsize=(11, 2.9 * len(rows) + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # drawn off screen, whatever backend pyplot has
    axes = fig.subplots(len(rows), 1, gridspec_kw={"height_ratios": rows})
    for ax, name in zip(axes, ["devices", "loss"] + (["difference"] if static else []) + ["downtime"]):
        ax.set_label(name)  # how a reader of the figure (a test) finds the panel
    for ax in axes[1:-1]:
        ax.sharex(axes[0])
    steps = MaxNLocator(integer=True, steps=[1, 2, 5, 10])  # whole steps, shared with the panels below
    axes[0].xaxis.set_major_locator(steps)
    labels = _devices_panel(axes[0], phases(recs), changed)
    _loss_panel(axes[1], elastic, static, changed)
    if static:
        _diff_panel(axes[2], elastic, static)
    axes[-2].set_xlabel("step")
    _downtime_panel(axes[-1], changed)
    fig.canvas.draw()  # lays the panels out, so the labels' sizes are known
    unclutter(fig, labels)
    return fig


def plot(run_dir: Path, out: Path, static: dict[int, float] | None = None) -> Path:
    """The run's figure, written to `out` (PNG)."""
    fig = figure(run_dir, static)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
