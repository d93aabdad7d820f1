"""`tenplex run` checks the whole schedule, its forced layouts, failures and para-config before the first
step (one line each, exit 2 on the CLI), and a script's own step count and snapshot interval stand unless
the command line sets them (then it says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outputs import failure
from tenplex.ptc import preset
from tenplex.ptc.layout import layouts
from tenplex.runtime.demo import SCHEDULE
from tenplex.runtime.runconfig import RunConfig
from tenplex.runtime.schedule import parse_schedule
from tenplex.runtime.validate import RunCheckError, check_run
from tenplex.train.config import TrainConfig

SRC = str(Path(__file__).resolve().parent.parent / "src")


def tenplex(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    cmd = [sys.executable, "-m", "tenplex.cli.main", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def config(schedule: list[dict], batch: int = 8, steps: int | None = 50, **kw) -> RunConfig:
    train = TrainConfig(model="tiny", global_batch=batch, device="cpu")
    return RunConfig(train, parse_schedule(schedule), steps, Path("unused"), **kw)


@pytest.mark.parametrize(
    ("schedule", "kw", "message"),
    [
        (
            [{"step": 0, "devices": 4, "layout": {"dp": 1, "tp": 3, "pp": 1}}],
            {},
            "event 0 (step 0: 4 devices layout dp=1,tp=3,pp=1): layout dp1-tp3-pp1 (sizes left out are 1) "
            "needs 3 devices, the job has 4 then",
        ),
        ([{"step": 0, "devices": 4}, {"step": 5, "layout": {"pp": 8}}], {}, "needs 8 devices, the job has 4"),
        ([{"step": 0, "devices": 8, "layout": {"pp": 8}}], {}, "pp=8 is more than the model's 2 layers"),
        (
            [{"step": 0, "devices": 3, "layout": {"tp": 3}}],
            {},
            "tp=3 does not divide the model's 4 attention heads",
        ),
        (
            [{"step": 0, "devices": 2}, {"step": 3, "fail": [7]}],
            {},
            "the job has 2 ranks then (0..1), no rank 7",
        ),
        (
            [{"step": 0, "devices": 2}, {"step": 5, "devices": 40}],
            {},
            "needs 40 devices, only 32 are available",
        ),
        (
            [{"step": 0, "devices": 2}, {"step": 5, "devices": 5}],
            {"devices_per_host": 1},
            "no layout of tiny fits 5 devices",
        ),
        ([{"step": 0, "devices": 4}, {"step": 5, "fail": [1]}], {}, "no layout of tiny fits 3 devices"),
        (
            [{"step": 0, "devices": 4}, {"step": 5, "fail_hosts": ["h3"]}],
            {},
            "host h3 runs none of the job's",
        ),
        ([{"step": 0, "devices": 2}, {"step": 5, "partition": ["h0"]}], {}, "needs namespace hosts"),
        ([{"step": 0, "devices": 2}, {"step": 5, "hosts": ["x1"]}], {}, "no host 'x1'"),
        (
            [{"step": 0, "devices": 4}, {"step": 2, "fail_hosts": ["h0"]}, {"step": 4, "hosts": ["h0"]}],
            {},
            "host h0 failed earlier",
        ),
        ([{"step": 0, "devices": 2}, {"step": 2, "fail": [0, 1]}], {}, "no devices are left"),
        (
            [{"step": 0, "devices": 2}],
            {"table": {"2": {"tp": 2, "dp": 2}}},
            "para-config entry 2: dp*tp*pp = 4",
        ),
        (
            [{"step": 0, "devices": 3}],
            {"table": {"3": {"tp": 3}}},
            "para-config entry 3: tp=3 does not divide",
        ),
        ([{"step": 0, "devices": 2, "layout": {"tp": 4}}], {"script": ["train.py"]}, "needs 4 devices"),
    ],
)
def test_each_problem_is_found_before_the_start_in_one_line(schedule, kw, message):
    with pytest.raises(RunCheckError) as e:
        check_run(config(schedule, **kw))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("schedule", "batch", "kw"),
    [
        (SCHEDULE, 12, {}),  # the demo: every dimension, a redeploy, a failure (a forced layout outlived)
        ([{"step": 0, "devices": 3}, {"step": 3, "fail": [2]}, {"step": 4, "devices": 3}], 12, {}),
        (
            [{"step": 0, "devices": 2}, {"step": 60, "devices": 40}],
            8,
            {},
        ),  # past the last step: never applies
        (
            [{"step": 0, "devices": 3, "layout": {"tp": 3}}],
            8,
            {"script": ["train.py"]},
        ),  # a script's own model
        ([{"step": 0, "devices": 2}], 8, {"table": {"2": {"pp": 2}}}),
    ],
)
def test_schedules_the_run_can_carry_out_pass(schedule, batch, kw):
    check_run(config(schedule, batch=batch, **kw))


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.sampled_from([4, 8, 12]))
@settings(max_examples=60, deadline=None)
def test_a_schedule_of_device_counts_passes_exactly_when_hosts_and_layouts_exist(counts, batch):
    """Checked against the rules themselves (the emulated hosts' 16 x 2 devices, the layouts the reference
    workload runs with that batch), not against the chooser the check asks."""
    schedule = [{"step": 5 * i, "devices": n} for i, n in enumerate(counts)]
    fits = all(n <= 32 and layouts(preset("tiny"), n, global_batch=batch, even_stages=True) for n in counts)
    try:
        check_run(config(schedule, batch=batch))
    except RunCheckError:
        assert not fits
    else:
        assert fits


def test_the_cli_says_one_line_and_exits_2_before_starting_anything(tmp_path):
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps([{"step": 0, "devices": 2}, {"step": 5, "fail": [7]}]))
    run_dir = tmp_path / "run"
    r = tenplex("run", "--schedule", str(schedule), "--run-dir", str(run_dir))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no rank 7" in r.stderr, r.stderr
    assert not run_dir.exists()


def test_every_run_flag_has_help_and_shows_its_default():
    from tenplex.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in ("run", "demo"):
        assert all(a.help for a in sub.choices[name]._actions), name
    text = " ".join(sub.choices["run"].format_help().split())
    for default in (
        "(default: tenplex-job)",
        "(default: 0.003)",
        "(default: 8)",
        "(default: 50;",
        "(default: 5;",
    ):
        assert default in text, default


SCRIPT = """
import torch
import tenplex

job = tenplex.ElasticJob("own", until=4, snapshot_every=3)
state = {"w": torch.zeros(4)}
step = job.resume(state)
while job.running(step):
    step += 1
    state["w"] += 1
    job.step_done(step, state, loss=float(step))
job.finish(state, step)
"""


@pytest.mark.dist
def test_a_scripts_own_steps_and_snapshots_stand_unless_the_command_line_sets_them(tmp_path):
    script = tmp_path / "own.py"
    script.write_text(SCRIPT)
    schedule = tmp_path / "s.json"
    schedule.write_text(json.dumps([{"step": 0, "devices": 2}]))

    def run(name: str, *extra: str) -> tuple[str, list[dict]]:
        run_dir = str(tmp_path / name)
        r = tenplex(
            "run",
            "--schedule",
            str(schedule),
            "--script",
            str(script),
            "--run-dir",
            run_dir,
            "--quiet",
            *extra,
        )
        assert r.returncode == 0, failure(r)
        recs = [json.loads(line) for line in (tmp_path / name / "timeline.jsonl").read_text().splitlines()]
        return r.stdout, [x for x in recs if x["kind"] == "worker"]

    out, recs = run("own")
    assert max(x["step"] for x in recs if x["event"] == "step") == 4
    assert [x["step"] for x in recs if x["event"] == "snapshot"] == [3]
    assert "overrides" not in out
    out, recs = run("cli", "--steps", "6", "--snapshot-every", "2")
    assert max(x["step"] for x in recs if x["event"] == "step") == 6
    assert [x["step"] for x in recs if x["event"] == "snapshot"] == [2, 4]
    said = [line for line in out.splitlines() if "overrides" in line]
    assert said == [
        "[tenplex] the command line overrides the script's own: --steps 6 (the script's until=4); "
        "--snapshot-every 2 (the script's snapshot_every=3)"
    ], out
