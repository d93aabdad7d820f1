"""The run's plot, read back from the matplotlib figure: what a look at it must show, checked without eyes.

The fixture (`tests/fixtures/demo-run`) is a real `tenplex demo --run-dir X`: `X/elastic/timeline.jsonl`
cut to the records and fields the report reads, and the losses of `X/static` — a scale-out, a layout change
at the same device count, a redeploy, rank 3 killed at step 43 (resumed from the snapshot at 40), a scale-in.
"""

from __future__ import annotations

import json
from itertools import combinations, pairwise
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from tenplex.runtime.history import KINDS, changes, losses, timeline
from tenplex.runtime.plot import figure, part, plot, unclutter
from tenplex.runtime.report import print_report, summary

RUN = Path(__file__).parent / "fixtures" / "demo-run"
STATIC = {int(k): v for k, v in json.loads((RUN / "static.json").read_text()).items()}
KIND_LABELS = ["scale out 2 → 4", "layout change", "redeploy", "failure", "scale in 3 → 2"]


@pytest.fixture(scope="module")
def panels():
    fig = figure(RUN, STATIC)
    return fig, {ax.get_label(): ax for ax in fig.axes}


def _texts(ax):
    return [t for t in ax.texts if t.get_text()]


def test_device_ticks_are_whole_devices_and_steps_whole_steps(panels):
    _, ax = panels
    lo, hi = ax["devices"].get_ylim()
    ticks = [t for t in ax["devices"].get_yticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert all(float(t).is_integer() for t in ax["loss"].get_xticks())


def test_every_change_is_marked_once_at_its_step_with_its_kind(panels):
    _, ax = panels
    marks = {t.get_text(): t.xy[0] for t in _texts(ax["devices"]) if t.get_text() in KIND_LABELS}
    assert marks == {"scale out 2 → 4": 10, "layout change": 20, "redeploy": 30, "failure": 43,
                     "scale in 3 → 2": 50}  # fmt: skip
    assert len([t for t in _texts(ax["devices"]) if t.get_text() in KIND_LABELS]) == len(KIND_LABELS)
    lines = sorted(line.get_xdata()[0] for line in ax["devices"].lines if line.get_linestyle() in (":", "--"))
    assert lines == [10, 20, 30, 43, 50]
    ticks = [t.get_text().splitlines()[0] for t in ax["downtime"].get_xticklabels()]
    assert ticks == KIND_LABELS and all(any(t.startswith(k) for k in KINDS) for t in ticks)


def test_the_failure_is_marked_at_the_step_its_rank_died_not_the_resume_step(panels):
    _, ax = panels
    died = next(r for r in timeline(RUN) if r["kind"] == "fail")
    (change,) = [c for c in changes(timeline(RUN)) if c["failure"]]
    assert (died["step"], change["step"], change["died"]) == (43, 40, 43)
    (note,) = [t for t in _texts(ax["devices"]) if "died" in t.get_text()]
    assert note.xy == (43, 4) and "rank 3 died at step 43" in note.get_text() and "step 40" in note.get_text()


def test_layout_changes_at_one_device_count_are_separate_bars(panels):
    """Phases 1 and 2 (4 devices, dp1-tp2-pp2 then dp2-tp1-pp2) and 3 (redeployed to h2 h3): a gap
    between each, each named by its layout and hosts."""
    _, ax = panels
    bars = [s for c in ax["devices"].collections for s in c.get_segments()]
    assert len(bars) == 6  # one per phase
    four = sorted((s[0][0], s[1][0]) for s in bars if s[0][1] == 4)
    assert len(four) == 3 and all(a[1] < b[0] for a, b in pairwise(four))
    names = [t.get_text() for t in _texts(ax["devices"])]
    assert {"dp1-tp2-pp2", "dp2-tp1-pp2", "dp2-tp2-pp1", "h0 h1", "h2 h3"} <= set(names)


def test_the_loss_difference_has_its_own_axis(panels):
    _, ax = panels
    elastic = losses(timeline(RUN))
    (line,) = [x for x in ax["difference"].lines if len(x.get_xdata()) > 2]
    want = [elastic[s] - STATIC[s] for s in line.get_xdata()]
    assert list(line.get_xdata()) == sorted(STATIC) and list(line.get_ydata()) == want
    span = ax["difference"].get_ylim()[1] - ax["difference"].get_ylim()[0]
    assert 0 < span < 1e-5 and max(map(abs, want)) > 0  # scaled to the difference, not to the loss


def test_downtime_bars_are_stacked_by_parts_that_add_up_to_the_downtime(panels):
    _, ax = panels
    changed = changes(timeline(RUN))
    heights: dict[float, list[float]] = {}
    for bar in ax["downtime"].patches:
        heights.setdefault(round(bar.get_x() + bar.get_width() / 2, 6), []).append(bar.get_height())
    assert len(heights) == len(changed)
    for (x, parts), c in zip(sorted(heights.items()), changed, strict=True):
        assert sum(parts) == pytest.approx(c["downtime"], abs=1e-9), (x, c["change"])
    legend = [t.get_text() for t in ax["downtime"].get_legend().get_texts()]
    assert {"save", "build", "load", "first step", "other"} <= set(legend)
    assert part(changed[0], "load", ["load", "other"]) == changed[0]["parts"]["load"]


def test_no_two_labels_overlap(panels):
    fig, _ax = panels
    renderer = fig.canvas.get_renderer()
    for a in fig.axes:
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _texts(a)]
        boxes += [(t.get_text(), t.get_window_extent(renderer)) for t in a.get_xticklabels() if t.get_text()]
        hits = [(p, q) for (p, b), (q, c) in combinations(boxes, 2) if b.overlaps(c)]
        assert not hits, (a.get_label(), hits)


def test_unclutter_moves_labels_that_would_overlap_apart():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4, 3))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    at = {"xytext": (0, 0), "textcoords": "offset points"}
    labels = [ax.annotate(t, (0.5, 0.3), **at) for t in ("a", "bb", "cc")]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert labels[0].get_window_extent(renderer).overlaps(labels[1].get_window_extent(renderer))
    unclutter(fig, labels)
    boxes = [t.get_window_extent(renderer) for t in labels]
    assert not any(a.overlaps(b) for a, b in combinations(boxes, 2))


def test_without_a_static_run_or_a_change_the_plot_says_so(tmp_path):
    recs = (RUN / "timeline.jsonl").read_text().splitlines()
    first = next(i for i, line in enumerate(recs) if '"reconfig"' in line)
    (tmp_path / "timeline.jsonl").write_text("\n".join(recs[:first]) + "\n")
    fig = figure(tmp_path)
    assert [a.get_label() for a in fig.axes] == ["devices", "loss", "downtime"]
    assert [t.get_text() for t in fig.axes[-1].texts] == ["no changes"]
    assert plot(tmp_path, tmp_path / "run.png").stat().st_size > 10_000


def test_the_table_names_changes_as_the_plot_does(capsys):
    print_report(summary(RUN, STATIC))
    out = capsys.readouterr().out
    assert all(k in out for k in KIND_LABELS) and "planned" not in out
    assert "43 (resumed 40)" in out


def test_the_live_view_names_each_change_in_the_tables_words(capsys):
    from tenplex.runtime.live import LiveView

    view = LiveView(60)
    base = {"from": "dp2-tp1-pp1", "to": "dp1-tp2-pp2", "downtime": 0.5, "parts": {"load": 0.2}}
    view.reconfig({**base, "failure": False, "redeploy": False, "devices": [2, 4]})
    view.reconfig({**base, "failure": False, "redeploy": True, "devices": [4, 4]})
    view.reconfig({**base, "failure": True, "redeploy": False, "devices": [4, 3]})
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" dp")[0].strip() for line in out] == ["scale out 2 → 4", "redeploy", "failure"], out
