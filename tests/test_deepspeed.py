"""DeepSpeed ZeRO engines through tenplex: a snapshot written under one stage and dp size loads into another,
and DeepSpeed's own gathered fp32 weights and Adam moments are bit for bit the saved ones
(tests/deepspeed_cases.py is the worker; real gloo ranks, a real store daemon)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launch import run_ranks
from script_runs import ROOT, elastic_and_static
from tenplex import TenplexError
from tenplex.runtime.report import losses, timeline

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
from tenplex.integrations.deepspeed import zero_stage
from tenplex.integrations.deepspeed_import import DeepSpeedCheckpointError, import_checkpoint

pytestmark = pytest.mark.dist

# a step after the change sums the gradients of 1-3 ranks in another order: fp32 round-off
STEP_LOSS_TOLERANCE = 1e-6
SCRIPT = ROOT / "examples" / "deepspeed_charlm.py"
SCHEDULE = ROOT / "examples" / "deepspeed_schedule.yaml"
STEPS = 10
# measured: ZeRO on 1-3 ranks reduces gradients in different orders; the losses left the static run's by
# at most 4.8e-7 (examples/deepspeed_schedule.yaml, twice)
LOSS_TOLERANCE = 2e-6


@pytest.fixture(scope="session", autouse=True)
def torch_extensions(tmp_path_factory):
    """DeepSpeed compiles a C++ op for its CPU communication on first use (~60 s): once per test run, into
    one directory every rank and every test's processes share (or the one $TORCH_EXTENSIONS_DIR names)."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.getbasetemp() / "torch_extensions")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return os.environ["TORCH_EXTENSIONS_DIR"]


def ranks(world: int, store, tmp_path, mode: str, cases: str, **env: str) -> list[dict]:
    """Every case's result on rank 0 (the cases, built one after the other in one world of `world`)."""
    env = {"TENPLEX_STORE": store.url, "DS_MODE": mode, "DS_CASES": cases, "DS_JOB": tmp_path.name,
           "DS_REF": str(tmp_path / "ref.pt"), **env}  # fmt: skip
    out = run_ranks("deepspeed_cases", world, env=env, timeout=300)
    return [dict(r, everyone=[x["cases"][i] for x in out]) for i, r in enumerate(out[0]["cases"])]


def check_load(r: dict) -> None:
    assert "error" not in r, r["message"]
    assert r["step"] == 3 and r["global_steps"] == 3
    assert len(r["names"]) == 15 and r["differ"] == [], r["differ"]  # 5 parameters x (master, 2 moments)
    assert r["adam_step"] and set(r["adam_step"]) == {3.0}
    loss, saved = r["next_loss"]
    assert loss == saved, (loss, saved)  # the same weights: the same loss, bit for bit
    loss, saved = r["step_loss"]
    assert abs(loss - saved) < STEP_LOSS_TOLERANCE, loss - saved
    assert all(x["next_loss"] == r["next_loss"] for x in r["everyone"])


def check_bad_input(spec: str, r: dict) -> None:
    """`3/14`: the first Linear 14 wide instead of 13; `2/13/frozen`: its embedding frozen."""
    if spec.endswith("frozen"):
        assert r.get("error") == "DeepSpeedStateError", r
        assert "frozen parameters are not carried" in r["message"]
    else:
        assert r.get("error") == "ShapeMismatchError", r
        assert "master.2." in r["message"] and "in the snapshot but" in r["message"]


# (the stage saved under on 2 ranks, {ranks: the engines loaded in turn}): every stage and dp size 1-3,
# and on one rank two engines the snapshot cannot load into (another model, a frozen parameter)
@pytest.mark.parametrize(
    ("saved", "loads"), [(2, {3: "2,3", 1: "2,0"}), (3, {3: "3,1", 1: "3,3/14,2/13/frozen"})]
)
def test_a_zero_snapshot_loads_bit_for_bit_into_other_dp_sizes_and_stages(store, tmp_path, saved, loads):
    (out,) = ranks(2, store, tmp_path, "save", str(saved))
    assert "error" not in out, out["message"]
    for world, cases in loads.items():
        for spec, r in zip(cases.split(","), ranks(world, store, tmp_path, "load", cases)):
            if "/" in spec:
                check_bad_input(spec, r)
            else:
                check_load(r)


@pytest.mark.parametrize(("saved", "loads"), [(2, {3: "3", 1: "1"}), (3, {1: "2,0"})])
def test_deepspeeds_own_checkpoint_imported_loads_bit_for_bit(store, tmp_path, saved, loads):
    """DeepSpeed's checkpoint of ZeRO-2 or ZeRO-3 on 2 ranks, imported (converted by DeepSpeed's
    ds_to_universal on the way), loads into other stages and dp sizes as tenplex's own snapshot does."""
    ckpt = tmp_path / "ckpt"
    (out,) = ranks(2, store, tmp_path, "save", str(saved), DS_CHECKPOINT=str(ckpt))
    assert "error" not in out, out["message"]
    job = f"{tmp_path.name}-imported"
    if saved == 2:
        assert import_checkpoint(ckpt / "global_step3", job, store=store.url) == 3
    else:  # the command line
        r = tenplex_cli("import", "deepspeed", str(ckpt / "global_step3"), "--job", job, "--store", store.url)
        assert r.returncode == 0 and f"as job {job} step 3" in r.stdout, r.stdout + r.stderr
    for world, cases in loads.items():
        for r in ranks(world, store, tmp_path, "load", cases, DS_JOB=job):
            check_load(r)
    with pytest.raises(DeepSpeedCheckpointError, match="no such folder"):
        import_checkpoint(ckpt / "global_step4", job, store=store.url)
    with pytest.raises(DeepSpeedCheckpointError, match="name the global_stepN folder"):
        import_checkpoint(ckpt, job, store=store.url)  # the folder above the checkpoint


def tenplex_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "tenplex.cli.main", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_importing_what_is_no_checkpoint_says_so_in_one_line(tmp_path):
    r = tenplex_cli("import", "deepspeed", str(tmp_path), "--job", "j")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "name the global_stepN folder" in r.stderr


def test_the_stage_table():
    assert [zero_stage(w, "3:3,1:0", 2) for w in (1, 2, 3)] == [0, 2, 3]
    for table in ("3:x", "3", "2:4"):
        with pytest.raises(TenplexError, match=r"--stages|ZeRO stage 4"):
            zero_stage(2, table, 2)


@pytest.mark.slow  # 100-184 s on 2 loaded cores (6 launches of DeepSpeed processes): over the 90 s bar
def test_deepspeed_charlm_changes_dp_and_stage_survives_a_killed_rank(tmp_path):
    """ZeRO-2 on 2 ranks -> ZeRO-3 on 3 -> ZeRO-2 on 2 -> a killed rank, ZeRO-1 on the one left, against a
    static run on one rank (ZeRO-1): the same losses, every sample once; the static run is the script
    without tenplex, bit for bit (a fresh start leaves the optimizer fresh); every rank that was not killed
    ends with exit code 0: the example tears the engine and the group down itself, leaving nothing of
    DeepSpeed's or gloo's to the interpreter's teardown, where ZeRO-3 processes were seen to abort after
    their work was done ("terminate called without an active exception"); that is a crash to the runtime."""
    script = f"{SCRIPT} --stages 3:3,1:1"
    recs = elastic_and_static(script, SCHEDULE, STEPS, tmp_path, "ds", LOSS_TOLERANCE)
    assert [len(x["devices"]) for x in recs if x["kind"] == "launch"] == [2, 3, 2, 1]
    loaded = [x for x in recs if x["kind"] == "worker" and x["event"] == "loaded"]
    assert [x["step"] for x in loaded] == [3, 5, 6] and all(x["source"] == "memory" for x in loaded)
    layouts = [x["layout"] for x in recs if x["kind"] == "worker" and x["event"] == "ready"]
    assert layouts == ["zero2-dp2", "zero3-dp3", "zero2-dp2", "zero1-dp1"], layouts
    assert not [x for x in recs if x["kind"] == "crash"]
    (plain,) = run_ranks("deepspeed_plain", 1, env={"DS_STEPS": str(STEPS)}, timeout=300)
    static = losses(timeline(tmp_path / "ds-static"))
    assert static == {int(k): v for k, v in plain.items()}
    print(loss_table(recs, static))  # the table the docs quote (pytest -s, or -rP)


def loss_table(recs: list[dict], static: dict[int, float]) -> str:
    """Every step the elastic run trained (a step replayed after the failure once per run of it) with its
    layout, its loss and the static run's, and the largest difference per layout."""
    rows, phase = [], ""
    for x in (x for x in recs if x["kind"] == "worker"):
        if x["event"] == "ready":
            phase = f"{x['layout']} from step {x['step']}"
        elif x["event"] == "step" and x.get("loss") is not None:
            rows.append((x["step"], phase, x["loss"], static[x["step"]]))
    lines = ["| step | phase | elastic | static (zero1-dp1) | diff |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {p} | {e:.7f} | {st:.7f} | {abs(e - st):.1e} |" for s, p, e, st in rows]
    worst: dict[str, float] = {}
    for _, p, e, st in rows:
        worst[p] = max(worst.get(p, 0.0), abs(e - st))
    return "\n".join(lines) + "\nmax diff per phase: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
