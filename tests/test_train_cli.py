"""`tenplex train` end to end (spawned ranks, metrics file) and the worker under torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from outputs import failure
from tenplex.cli.main import main
from tenplex.ptc import PTCError
from tenplex.train.launch import LaunchError, spawn
from tenplex.train.metrics import read_metrics

pytest.importorskip("torch")
pytestmark = pytest.mark.dist

SOURCE = str(Path(json.__file__).parent)


def test_train_command_writes_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("TENPLEX_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "m.jsonl"
    argv = ["train", "--dp", "2", "--steps", "3", "--source", SOURCE, "--metrics", str(out), "--no-progress"]
    assert main(argv) == 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["layout"] == "dp2-tp1-pp1" and r["tokens"] == 8 * 64 and r["tokens_per_s"] > 0 for r in rows)
    assert len([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]) == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "3"], "does not divide"),
        (["--pp", "3"], "more than the model's 2 layers"),
        (["--dp", "4", "--global-batch", "2"], "at least one sample"),
        (["--dp", "3", "--pp", "2", "--micro-batch", "2"], "equal micro-batches"),
        (["--model", "nope"], "unknown model"),
    ],
)
def test_user_errors_are_one_line(
    flags: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("TENPLEX_CACHE", str(tmp_path / "cache"))
    assert main(["train", "--steps", "1", "--source", SOURCE, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tenplex: error:") and message in err[-1]


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="torchrun not installed",
)
def test_worker_under_torchrun(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    env = {**os.environ, "TENPLEX_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tenplex.train.trainer",
        "--pp",
        "2",
        "--steps",
        "2",
        "--source",
        SOURCE,
        "--metrics",
        str(tmp_path / "m.jsonl"),
    ]
    done = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, failure(done)
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2]


def _fail() -> None:
    raise PTCError("bad layout")


def _unpicklable() -> object:
    return lambda: None


def test_spawn_reports_the_failing_rank_instead_of_hanging() -> None:
    with pytest.raises(LaunchError, match="rank 0 failed: PTCError: bad layout"):
        spawn(_fail, 1)
    with pytest.raises(LaunchError, match=r"rank 0 failed: .*(pickle|Pickl)"):
        spawn(_unpicklable, 1)


CHOICES = [("auto", 0, 1, False), ("auto", 1, 1, True), ("auto", 1, 2, False), ("auto", 8, 8, True),
           ("cpu", 8, 1, False), ("cuda", 1, 4, True)]  # fmt: skip


@pytest.mark.parametrize(("device", "gpus", "local", "want"), CHOICES)
def test_auto_takes_gpus_only_when_every_local_rank_gets_one(monkeypatch, capsys, device, gpus, local, want):
    """Found on a 1-GPU machine: `tenplex train --dp 2` (auto) put both ranks on cuda:0, and the second
    failed with an invalid device ordinal."""
    import torch

    from tenplex.transformer import world

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(world, "_told_cpu", [])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert world.use_cuda(device) is want
    assert ("on the CPU" in capsys.readouterr().err) is (device == "auto" and 0 < gpus < local)
