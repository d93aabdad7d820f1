"""`tenplex export dcp`: any job's snapshot (here one saved from a plain process: several dtypes, a piece-free
state, values) as a DCP folder that torch's own `torch.distributed.checkpoint.load` reads bit for bit."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

import tenplex


def test_any_snapshot_exports_to_a_dcp_folder_torch_reads_bitwise(store, tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(5, 7, generator=g),
        "half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (6,), generator=g),
        "nested": {"b": torch.randn(2, generator=g, dtype=torch.float64)},
        "step": 7,
    }
    tenplex.save(state, "export-any", 7, store=store.url)
    out = tmp_path / "dcp"
    args = ["export", "dcp", str(out), "--job", "export-any", "--store", store.url]
    r = subprocess.run([sys.executable, "-m", "tenplex.cli.main", *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "step 7" in r.stdout
    want = {"w": state["w"], "half": state["half"], "ids": state["ids"], "nested.b": state["nested"]["b"]}
    read = {k: torch.zeros_like(t) for k, t in want.items()}
    dcp.load(read, checkpoint_id=str(out), no_dist=True)
    for k, t in want.items():
        assert read[k].dtype == t.dtype and torch.equal(read[k].view(torch.uint8), t.view(torch.uint8)), k
