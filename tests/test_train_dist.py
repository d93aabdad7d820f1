"""Every (dp, tp, pp) layout, FSDP, uneven dp splits and a cross-layout restore train the *same* model.

Real multi-process gloo groups: one spawn per world size (1, 2, 4) runs all cases of that size (spawning
and importing torch cost more than the tiny model's 20 steps), results compared here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from tenplex.data import build_corpus
from tenplex.train.cases import Case, CaseResult, run_cases
from tenplex.train.launch import spawn
from tenplex.train.trainer import TrainConfig

pytestmark = pytest.mark.dist

STEPS = 20
BASE = TrainConfig(model="tiny", steps=STEPS, global_batch=8, micro_batch=2, seed=7, lr=3e-3, warmup=5)

# Measured on the 2-core CPU dev machine (torch 2.13, gloo, fp32) over 20 steps (test_report_... prints them):
# largest |loss - single-process loss| over every layout and step 4.8e-7 (tp layouts; dp/pp alone 2.4e-7);
# largest |parameter - single-process parameter| after 20 steps 4.0e-6 (FSDP dp=4, uneven split).
# Tolerances: those numbers with a ~4-5x margin.
LOSS_TOL = 2e-6
PARAM_TOL = 2e-5


def cfg(dp: int = 1, tp: int = 1, pp: int = 1, **kw: object) -> TrainConfig:
    return replace(BASE, dp=dp, tp=tp, pp=pp, **kw)


LAYOUTS = [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    import json

    tmp = tmp_path_factory.mktemp("train")
    corpus = build_corpus([Path(json.__file__).parent], root=tmp / "corpus")
    ckpt = str(tmp / "ckpt")
    worlds: dict[int, dict[str, Case]] = {
        1: {
            "ref": Case(cfg(), record_params=True),
            "ref-gb6": Case(cfg(global_batch=6), record_params=True),
        },
        2: {
            # (2,1,1) also saves its state at step 10 for the restore case below
            "2,1,1": Case(cfg(2, 1, 1), record_params=True, save_at=10, checkpoint=ckpt),
            "1,2,1": Case(cfg(1, 2, 1), record_params=True),
            "1,1,2": Case(cfg(1, 1, 2), record_params=True),
            "1,1,2-gpipe": Case(cfg(1, 1, 2, pp_schedule="gpipe"), record_params=True),
            "2,1,1-fsdp": Case(cfg(2, 1, 1, fsdp=True), record_params=True),
        },
        4: {
            "2,2,1": Case(cfg(2, 2, 1), record_params=True),
            "1,2,2": Case(cfg(1, 2, 2), record_params=True),
            "2,1,2": Case(cfg(2, 1, 2), record_params=True),
            "2,2,1-fsdp": Case(cfg(2, 2, 1, fsdp=True), record_params=True),
            "4,1,1-gb6": Case(cfg(4, 1, 1, global_batch=6), record_params=True),
            "4,1,1-gb6-fsdp": Case(cfg(4, 1, 1, global_batch=6, fsdp=True), record_params=True),
            # dp 2 -> 1, tp 1 -> 2, pp 1 -> 2 at step 10, through a DCP checkpoint of the job state
            "restore-1,2,2": Case(cfg(1, 2, 2), record_params=True, load=True, checkpoint=ckpt),
            "restore-4,1,1": Case(cfg(4, 1, 1), record_params=True, load=True, checkpoint=ckpt),  # dp 2 -> 4
        },
    }
    out: dict[str, dict] = {}
    for world, cases in worlds.items():
        for case in cases.values():
            case.evaluate = 2  # held-out loss after the last step, through the same layout
        per_rank: list[list[CaseResult]] = spawn(run_cases, world, list(cases.values()), str(corpus.path))
        for i, name in enumerate(cases):
            ranks = [r[i] for r in per_rank]
            params: dict[str, np.ndarray] = {}
            for r in ranks:
                params.update(r.params)
            out[name] = {
                "loss": np.array(ranks[0].losses),
                "norm": np.array(ranks[0].grad_norms),
                "steps": ranks[0].steps,
                "params": params,
                "val": ranks[0].val_loss,
            }
    return out


def _param_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _report(results: dict[str, dict]) -> dict[str, tuple[float, float, float]]:
    """Largest loss, parameter and held-out loss differences of every case against its single-process
    reference."""
    diffs = {}
    for name, r in results.items():
        if name.startswith("ref"):
            continue
        ref = results["ref-gb6" if "gb6" in name else "ref"]
        lo = len(ref["loss"]) - len(r["loss"])
        diffs[name] = (
            float(np.abs(r["loss"] - ref["loss"][lo:]).max()),
            _param_diff(r["params"], ref["params"]),
            abs(r["val"] - ref["val"]),
        )
    return diffs


@pytest.mark.parametrize("layout", [",".join(map(str, lay)) for lay in LAYOUTS])
def test_layout_matches_single_process(results: dict[str, dict], layout: str) -> None:
    ref, r = results["ref"], results[layout]
    assert len(r["loss"]) == STEPS
    assert r["loss"][-1] < r["loss"][0] - 0.1  # it learns
    np.testing.assert_allclose(r["loss"], ref["loss"], rtol=0, atol=LOSS_TOL)
    np.testing.assert_allclose(r["norm"], ref["norm"], rtol=1e-4)
    assert r["val"] == pytest.approx(ref["val"], abs=LOSS_TOL)
    assert r["val"] < ref["loss"][0]  # the held-out loss of the trained model fell too
    assert _param_diff(r["params"], ref["params"]) <= PARAM_TOL


@pytest.mark.parametrize("name", ["2,1,1-fsdp", "2,2,1-fsdp", "4,1,1-gb6-fsdp"])
def test_fsdp_on_off_equivalent(results: dict[str, dict], name: str) -> None:
    off = results[name.removesuffix("-fsdp")]
    np.testing.assert_allclose(results[name]["loss"], off["loss"], rtol=0, atol=LOSS_TOL)
    assert results[name]["val"] == pytest.approx(off["val"], abs=LOSS_TOL)
    assert _param_diff(results[name]["params"], off["params"]) <= PARAM_TOL


def test_uneven_dp_split_matches_static_gradient(results: dict[str, dict]) -> None:
    """6 samples over dp=4 (parts 2,2,1,1) with per-sample loss weighting: same run as 1 process."""
    ref, r = results["ref-gb6"], results["4,1,1-gb6"]
    np.testing.assert_allclose(r["loss"], ref["loss"], rtol=0, atol=LOSS_TOL)
    assert _param_diff(r["params"], ref["params"]) <= PARAM_TOL


def test_gpipe_and_1f1b_agree(results: dict[str, dict]) -> None:
    np.testing.assert_allclose(
        results["1,1,2-gpipe"]["loss"], results["1,1,2"]["loss"], rtol=0, atol=LOSS_TOL
    )


@pytest.mark.parametrize("name", ["restore-1,2,2", "restore-4,1,1"])
def test_restore_into_another_layout_continues_the_same_run(results: dict[str, dict], name: str) -> None:
    """(2,1,1) saved at step 10, restored into another layout: steps 11..20 are the uninterrupted run's."""
    ref, r = results["ref"], results[name]
    assert r["steps"] == list(range(11, STEPS + 1))
    assert r["val"] == pytest.approx(ref["val"], abs=LOSS_TOL)
    np.testing.assert_allclose(r["loss"], ref["loss"][10:], rtol=0, atol=LOSS_TOL)
    assert _param_diff(r["params"], ref["params"]) <= PARAM_TOL


def test_report_measured_differences(results: dict[str, dict], capsys: pytest.CaptureFixture) -> None:
    diffs = _report(results)
    with capsys.disabled():
        print("\nmax |loss diff|, max |param diff|, |held-out loss diff| vs single process:")
        for name, (dl, dparam, dval) in diffs.items():
            print(f"  {name:16s} {dl:.2e} {dparam:.2e} {dval:.2e}")
    assert all(dl <= LOSS_TOL and dp <= PARAM_TOL and dv <= LOSS_TOL for dl, dp, dv in diffs.values())
