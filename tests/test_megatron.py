"""Megatron-core's GPTModel state, named as its own torch_dist checkpoints name it, resharded by tenplex
across TP and PP on 2 real gloo ranks: bit for bit against Megatron's own `dist_checkpointing`; AdamW
moments across a TP change; torch_dist checkpoints imported and exported by the CLI without the model;
what is refused."""

from __future__ import annotations

import argparse

import pytest
import torch

from launch import run_ranks
from tenplex.cli.main import main

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")


@pytest.mark.dist
def test_state_moments_and_torch_dist_checkpoints_reshard_bit_for_bit(store, tmp_path):
    out = run_ranks("megatron_cases", 2, env={"TENPLEX_STORE": store.url, "TENPLEX_TEST_DIR": str(tmp_path)},
                    timeout=240)  # fmt: skip
    for r in out:
        assert "error" not in r, r.get("error")
        assert r["bad"] == [], r["bad"]
        assert r["optimizer_bad"] == [], r["optimizer_bad"]
        assert r["checkpoint_bad"] == [], r["checkpoint_bad"]
        assert set(r["unlike"].values()) == {0}, r["unlike"]  # every target tensor was unlike the source's
    print("seconds (rank 0):", out[0]["seconds"])  # tiny state: per-call overheads, not bandwidth
    names = out[0]["names"]  # 17 tensors (stacked layers: one key each) and 8 None objects, as Megatron wrote
    assert "decoder.layers.self_attention.linear_qkv.weight" in names and len(names) == 25, names
    assert "decoder.layers.mlp.linear_fc1._extra_state/shard_1_2" in names, names
    refused = out[0]["refusals"]
    assert refused["object"].startswith("MegatronLayoutError") and "is an object (dict)" in refused["object"]
    assert refused["shape"].startswith("ShapeMismatchError"), refused
    group = refused["import in a group"]  # not a hang: the import is for one process
    assert group.startswith("MegatronCheckpointError") and "from one process" in group, refused
    # a third layer: its objects are named by the layer count (shard_0_3) before any shape is compared
    assert refused["layers"].startswith("KeyMismatchError") and "shard_0_3" in refused["layers"], refused


def test_cli_refuses_what_is_no_torch_dist_checkpoint_in_one_line(store, tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    for name, common in {
        "torn": None,
        "args": argparse.Namespace(lr=1.0),
        "iteration": {"iteration": 5},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        if common is not None:  # Megatron-LM's common state: never unpickled as code, refused either way
            torch.save(common, tmp_path / name / "common.pt")
    cases = {
        "cannot read common.pt": ["import", "megatron", str(tmp_path / "torn"), "--job", "j"],
        "objects that are not plain data": ["import", "megatron", str(tmp_path / "args"), "--job", "j"],
        "common state ['iteration']": ["import", "megatron", str(tmp_path / "iteration"), "--job", "j"],
        "no such folder": ["import", "megatron", str(tmp_path / "nowhere"), "--job", "j"],
        "no metadata.json": ["import", "megatron", str(tmp_path), "--job", "j"],
        "sharded_backend 'zarr'": ["import", "megatron", str(tmp_path / "x"), "--job", "j"],
        "exists; name a new folder": [
            "export",
            "megatron",
            str(tmp_path),
            "--job",
            "j",
            "--store",
            store.url,
        ],
    }
    for want, args in cases.items():  # the CLI's own entry, in this process (megatron is imported already)
        code, err = main(args), capsys.readouterr().err
        assert code == 2, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tenplex: error:") and want in lines[0], err
