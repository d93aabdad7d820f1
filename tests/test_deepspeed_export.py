"""tenplex's export to DeepSpeed's universal checkpoint, loaded by DeepSpeed's own `engine.load_checkpoint`
on other dp sizes and stages: DeepSpeed's gathered fp32 weights and Adam moments bit for bit the saved ones
(tests/deepspeed_cases.py is the worker; real gloo ranks, a real store daemon)."""

from __future__ import annotations

import re

import pytest
import torch

import tenplex

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
from tenplex.integrations.deepspeed_export import DeepSpeedExportError, export_checkpoint
from tenplex.integrations.deepspeed_import import import_checkpoint, to_universal
from test_deepspeed import check_load, ranks, tenplex_cli, torch_extensions  # noqa: F401 (a fixture)

pytestmark = pytest.mark.dist


def test_a_tenplex_snapshot_exported_loads_in_deepspeed_bit_for_bit(store, tmp_path):
    """ZeRO-2 on 2 ranks saved by tenplex, exported, loaded by DeepSpeed as ZeRO-3 and ZeRO-2 on 3 ranks and
    ZeRO-1 on one."""
    (out,) = ranks(2, store, tmp_path, "save", "2")
    assert "error" not in out, out["message"]
    folder = tmp_path / "universal"
    assert export_checkpoint(tmp_path.name, folder, store=store.url) == folder / "global_step3"
    assert (folder / "latest_universal").read_text() == "global_step3"
    for world, cases in {3: "3,2", 1: "1"}.items():
        for r in ranks(world, store, tmp_path, "universal", cases, DS_EXPORT=str(folder)):
            check_load(r)


def test_deepspeed_to_tenplex_to_deepspeed_round_trips_bit_for_bit(store, tmp_path):
    """DeepSpeed's ZeRO-3 checkpoint on 2 ranks, converted by its own ds_to_universal, imported, exported (the
    command line): the same tensors as ds_to_universal wrote, and DeepSpeed loads them on 1 rank (ZeRO-2)."""
    ckpt = tmp_path / "ckpt"
    (out,) = ranks(2, store, tmp_path, "save", "3", DS_CHECKPOINT=str(ckpt))
    assert "error" not in out, out["message"]
    theirs = to_universal(ckpt / "global_step3", tmp_path / "ds" / "global_step3")
    job = f"{tmp_path.name}-imported"
    assert import_checkpoint(theirs, job, store=store.url) == 3  # a ZeRO folder is converted so first
    folder = tmp_path / "exported"
    r = tenplex_cli("export", "deepspeed", str(folder), "--job", job, "--store", store.url)
    assert r.returncode == 0 and "global_step3" in r.stdout, r.stdout + r.stderr
    names = sorted(p.name for p in (theirs / "zero").iterdir() if p.is_dir())
    assert names == sorted(p.name for p in (folder / "global_step3" / "zero").iterdir() if p.is_dir())
    assert len(names) == 5
    ours = folder / "global_step3"
    for name in names:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            mine, ds = (torch.load(f / "zero" / name / f"{key}.pt") for f in (ours, theirs))
            ds = ds["param"] if isinstance(ds, dict) else ds  # DeepSpeed writes ZeRO-3's flat
            assert torch.equal(mine["param"].view(-1), ds.view(-1)), (name, key)
    (r,) = ranks(1, store, tmp_path, "universal", "2", DS_EXPORT=str(folder))
    check_load(r)


def _saved(store, job: str, state: dict) -> None:
    tenplex.save(state, job=job, step=1, store=store.url)


def deepspeed_like(**drop: bool) -> dict:
    """What DeepSpeedState saves for one 2x2 parameter `w`, less what `drop` names."""
    state = {
        "master": {"w": torch.ones(4)},
        "optim": {"exp_avg": {"w": torch.zeros(4)}, "exp_avg_sq": {"w": torch.zeros(4)}},
        "groups": {0: {"settings": {"lr": 0.1, "betas": (0.9, 0.99)}, "state": {"step": 1.0}}},
        "shapes": {"w": [2, 2]},
        "engine": {"global_steps": 1, "global_samples": 4, "skipped_steps": 0, "micro_steps": 1},
    }
    return {k: v for k, v in state.items() if not drop.get(k)}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"w": torch.zeros(3)}, "not a snapshot saved with DeepSpeedState"),
        (deepspeed_like(optim=True), "no optimizer moment optim.exp_avg.w"),
        (deepspeed_like(shapes=True), "no shape of w"),
        ({**deepspeed_like(), "shapes": {"w": [3]}}, "master.w has 4 elements, its shape [3] not"),
    ],
)
def test_what_the_universal_format_cannot_hold_is_refused(store, tmp_path, state, message):
    _saved(store, tmp_path.name, state)
    with pytest.raises(DeepSpeedExportError, match=re.escape(message)):
        export_checkpoint(tmp_path.name, tmp_path / "out", store=store.url)
    assert not (tmp_path / "out" / "global_step1").exists()


def test_a_deepspeed_like_snapshot_is_written_in_deepspeeds_layout(store, tmp_path):
    _saved(store, tmp_path.name, deepspeed_like())
    out = export_checkpoint(tmp_path.name, tmp_path / "out", store=store.url)
    assert sorted(p.name for p in (out / "zero" / "w").iterdir()) == [
        "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"
    ]  # fmt: skip
    assert torch.load(out / "zero" / "w" / "fp32.pt")["param"].shape == (2, 2)
    groups = torch.load(out / "zero" / "optimizer_state.pt")["optimizer_state_dict"]["param_groups"]
    assert groups == [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]
    model = torch.load(out / "mp_rank_00_model_states.pt", weights_only=False)
    assert (model["global_steps"], model["ds_config"]) == (1, {"gradient_accumulation_steps": 1})


def test_exporting_what_is_no_snapshot_says_so_in_one_line(store, tmp_path):
    r = tenplex_cli("export", "deepspeed", str(tmp_path), "--job", "no-such-job", "--store", store.url)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("tenplex: error:") and "no-such-job" in r.stderr, r.stderr
