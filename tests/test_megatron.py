"""Megatron-core's GPTModel state, from its own `sharded_state_dict()`, resharded by tenplex across TP and
PP on 2 real gloo ranks: bit for bit against the source and against Megatron's own `dist_checkpointing`;
AdamW moments across a TP change; torch_dist checkpoints imported and exported; what is refused."""

from __future__ import annotations

import pytest

from launch import run_ranks

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

pytestmark = pytest.mark.dist


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
    names = out[0]["names"]
    assert "decoder.layers.self_attention.linear_qkv.weight[1]" in names and len(names) == 29, names
    refused = out[0]["refusals"]
    assert refused["object"].startswith("MegatronLayoutError") and "is an object (dict)" in refused["object"]
    assert refused["offset"].startswith("MegatronLayoutError") and "offset" in refused["offset"]
    assert refused["shape"].startswith("ShapeMismatchError"), refused
    assert refused["unknown key"].startswith("KeyMismatchError") and "[2]" in refused["unknown key"], refused
