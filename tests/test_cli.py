"""The commands as users run them: real processes, exit codes, one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest


def tenplex(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    e = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "tenplex.cli.main", *args], capture_output=True, text=True, env=e, timeout=120
    )


def test_plan_json_has_the_documented_fields():
    r = tenplex("plan", "--model", "gpt3-2.7b", "--from", "dp=1,tp=4,pp=2", "--to", "dp=2,tp=4,pp=2",
                "--devices-per-host", "4", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for key in ("kept", "same_host", "cross_host", "cross_host_lower_bound", "total_state"):
        assert isinstance(d["bytes"][key], int)
    assert d["bytes"]["cross_host"] == d["bytes"]["cross_host_lower_bound"] > 0
    assert d["central"]["bytes"]["cross_host"] > d["bytes"]["cross_host"]
    assert d["plan_seconds"] < 5 and d["unrecoverable"] == []
    # ranks matched to the devices holding their state, unless asked to take devices in numbering order
    assert d["assignment"]["mode"] == "match" and len(d["assignment"]["devices"]) == 16
    assert d["assignment"]["cross_host_by_numbering"] > 1.4 * d["bytes"]["cross_host"]
    r = tenplex("plan", "--model", "gpt3-2.7b", "--from", "dp=1,tp=4,pp=2", "--to", "dp=2,tp=4,pp=2",
                "--devices-per-host", "4", "--assign", "numbering", "--json")  # fmt: skip
    n = json.loads(r.stdout)
    assert (
        n["bytes"]["cross_host"]
        == n["assignment"]["cross_host_by_numbering"]
        == d["assignment"]["cross_host_by_numbering"]
    )


def test_plan_lost_hosts_lists_unrecoverable_boxes():
    r = tenplex("plan", "--model", "tiny", "--from", "dp=1,tp=2,pp=2", "--to", "dp=1,tp=2,pp=1",
                "--devices-per-host", "2", "--lost-hosts", "1", "--json")  # fmt: skip
    d = json.loads(r.stdout)
    names = {u["tensor"] for u in d["unrecoverable"]}
    assert "model.blocks.1.attn.qkv.weight" in names and "model.blocks.0.attn.qkv.weight" not in names


def test_plan_prints_a_table():
    r = tenplex("plan", "--model", "tiny", "--from", "dp=1", "--to", "dp=2", "--devices-per-host", "1")
    assert r.returncode == 0 and "moved across hosts" in r.stdout and "central" in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt5", "--from", "dp=1", "--to", "dp=2"], "unknown model 'gpt5'"),
        (
            ["--model", "tiny", "--from", "tp=3", "--to", "dp=2"],
            "tp=3 does not divide the model's 4 attention heads",
        ),
        (["--model", "tiny", "--from", "pp=3", "--to", "dp=2"], "pp=3 is more than the model's 2 layers"),
        (["--model", "tiny", "--from", "dp=2,tp=2", "--to", "dp=2", "--devices", "3"], "needs 2 devices"),
        (["--model", "tiny", "--from", "dp=two", "--to", "dp=2"], "malformed layout 'dp=two'"),
        (["--model", "tiny", "--from", "xx=1", "--to", "dp=2"], "malformed layout 'xx=1'"),
        (["--model", "tiny", "--from", "dp=0", "--to", "dp=2"], "dp must be at least 1"),
        (["--model", "tiny", "--from", "dp=1", "--to", "dp=2", "--lost-hosts", "7"], "--lost-hosts 7"),
        (["--model", "tiny", "--from", "dp=1"], "required: --to"),
    ],
)
def test_plan_rejects_bad_input_with_one_line_and_exit_2(args, message):
    r = tenplex("plan", *args)
    assert r.returncode == 2
    assert message in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_inspect_shows_a_snapshot_and_rejects_unknown_jobs():
    import torch

    import tenplex as tx
    from tenplex.store import start_store

    with start_store() as sp:
        tx.save({"model": torch.nn.Linear(7, 13), "step": 3}, job="insp", step=3, store=sp.url)
        r = tenplex("inspect", "--job", "insp", "--store", sp.url, "--json")
        assert r.returncode == 0, r.stderr
        d = json.loads(r.stdout)
        assert d["step"] == 3 and d["values"] == ["step"]
        assert {p["tensor"] for p in d["pieces"]} == {"model.weight", "model.bias"}
        assert d["pieces"][0]["holders"] == [f"r0@{sp.url}"]
        r = tenplex("inspect", "--job", "nope", "--store", sp.url)
        assert r.returncode == 2 and "job 'nope' has no committed version" in r.stderr


def test_sigusr1_prints_every_threads_stack_and_the_command_goes_on(tmp_path):
    """What a command that seems stuck waits for: `kill -USR1` (here on a foreground store daemon)."""
    import os
    import signal
    import time

    from launch import SRC

    env = dict(os.environ, PYTHONPATH=str(SRC))
    err = tmp_path / "err"
    with open(err, "w") as e:
        cmd = [sys.executable, "-m", "tenplex.cli.main", "store", "--port", "0", "--memory-limit", "64MiB"]
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=e, text=True)
    try:
        assert "listening on" in p.stdout.readline()
        p.send_signal(signal.SIGUSR1)
        deadline = time.time() + 10
        while "in <module>" not in err.read_text() and time.time() < deadline:  # the main thread's last
            time.sleep(0.1)
        stacks = err.read_text()
        assert "Current thread" in stacks and "_accept_loop" in stacks, stacks[-2000:]
        assert p.poll() is None  # still serving
    finally:
        p.terminate()
        p.wait(20)
    assert p.returncode == 0


def _every_option() -> list[tuple[str, argparse.Action]]:
    """(command path, action) for every option and positional of every (sub-)command, aliases once."""
    from tenplex.cli.main import build_parser

    out, seen = [], set()
    todo = [("tenplex", build_parser())]
    while todo:
        path, parser = todo.pop()
        if id(parser) in seen:
            continue
        seen.add(id(parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{path} {name}", p) for name, p in action.choices.items()]
            elif not isinstance(action, argparse._HelpAction):
                out.append((path, action))
    return out


def test_every_flag_of_every_command_says_what_it_does_and_its_default():
    from tenplex.cli.main import _HelpFormatter

    options = _every_option()
    assert len(options) > 150 and {p for p, _ in options} >= {"tenplex choose", "tenplex store ls"}
    shown = _HelpFormatter("tenplex")
    missing, no_default = [], []
    for path, action in options:
        flag = "/".join(action.option_strings) or action.dest
        if getattr(action, "renamed_to", None):  # a refused old spelling, hidden on purpose
            assert action.help == argparse.SUPPRESS, flag
        elif not action.help or action.help == argparse.SUPPRESS:
            missing.append(f"{path} {flag}")
        elif action.default not in (None, False, "", []) and not isinstance(action.default, bool):
            text = shown._get_help_string(action) % {"default": action.default}
            if "default" not in text:  # the formatter's "(default: X)", or the help's own words
                no_default.append(f"{path} {flag}: {text!r}")
    assert not missing, "options without help text:\n" + "\n".join(sorted(missing))
    assert not no_default, "options whose help hides their default:\n" + "\n".join(sorted(no_default))


def test_train_refuses_the_old_pipeline_schedule_spelling_with_a_pointer():
    r = tenplex("train", "--pp", "2", "--schedule", "gpipe")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--schedule is now --pp-schedule" in r.stderr
    from tenplex.train.config import TrainConfig, add_train_args, config_from_args

    p = argparse.ArgumentParser()
    add_train_args(p)
    assert config_from_args(p.parse_args(["--pp-schedule", "gpipe"])).pp_schedule == "gpipe"
    assert "schedule" not in TrainConfig.__dataclass_fields__  # `run --schedule` alone means a schedule


def test_plan_unrecoverable_line_pairs_a_tensor_with_its_own_box():
    from tenplex.ptc import Box

    args = ["plan", "--model", "tiny", "--from", "dp=1,tp=2,pp=2", "--to", "dp=1,tp=2,pp=1",
            "--devices-per-host", "2", "--lost-hosts", "1"]  # fmt: skip
    lost = json.loads(tenplex(*args, "--json").stdout)["unrecoverable"]
    first = min(u["tensor"] for u in lost)
    assert lost[0]["tensor"] != first  # the case where the first-named tensor is not the first box listed
    line = next(ln for ln in tenplex(*args).stdout.splitlines() if ln.startswith("UNRECOVERABLE"))
    shown = line.split("e.g. ", 1)[1]
    assert shown.startswith(first + " ")
    assert shown in {f"{u['tensor']} {Box.from_json(u['box'])}" for u in lost}, (shown, lost[:3])


def _describe(tmp_path, spec, name: str = "model.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(spec.to_json()))
    return str(path)


def test_a_model_description_file_plans_and_ranks_as_the_preset_it_describes(tmp_path):
    from tenplex.ptc.gpt import gpt_spec, preset

    path = _describe(tmp_path, gpt_spec(preset("small")))
    layouts = ["--from", "dp=1,tp=2,pp=2", "--to", "dp=2,tp=4,pp=1", "--devices-per-host", "2", "--json"]
    a, b = (json.loads(tenplex("plan", "--model", m, *layouts).stdout) for m in ("small", path))
    for d in (a, b):
        del d["model"], d["plan_seconds"], d["central"]["plan_seconds"]
    assert a == b and a["bytes"]["cross_host"] > 0
    a, b = (
        json.loads(tenplex("choose", "--model", m, "--devices", "4", "--json").stdout)
        for m in ("small", path)
    )
    assert a["ranking"] == b["ranking"] and len(a["ranking"]) == 6
    assert b["choice"]["tp"] == 1 or b["choice"] == {**b["ranking"][0], "from": "cost model"}


@pytest.mark.parametrize(
    ("description", "message"),
    [
        ({"tensors": [{"name": "w", "shape": [4, 4], "tp_dim": 0}]}, "need `heads`"),
        (
            {"heads": 2, "tensors": [{"name": "w", "shape": [4, 4], "tp_dim": 2}]},
            "tp_dim 2 is not one of its 2 dims",
        ),
        ({"tensors": [{"name": "w", "shape": [4], "layer": "middle"}]}, "layer 'middle' is not"),
        ({"tensors": [{"name": "w", "shape": [4], "split": 0}]}, "unknown keys split"),
        ({"tensors": [{"name": "w", "shape": [4], "dtype": "float8"}]}, "tensor 'w': "),
        (
            {"layers": 2, "tensors": [{"name": "w", "shape": [4], "layer": 5}]},
            "names layer 5, but the model has 2",
        ),
        ({"heads": 3, "tensors": [{"name": "w", "shape": [6], "tp_dim": 0}]}, "tp=2 does not divide"),
        ([], "a model description is"),
    ],
)
def test_a_bad_model_description_is_one_line_and_exit_2(tmp_path, description, message):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(description))
    r = tenplex("plan", "--model", str(path), "--from", "tp=1", "--to", "tp=2")
    assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = tenplex("plan", "--model", str(tmp_path / "nope.yaml"), "--from", "tp=1", "--to", "tp=2")
    assert r.returncode == 2 and "no such model description file" in r.stderr


def test_a_snapshot_on_the_stores_is_planned_ranked_inspected_and_listed(tmp_path):
    """`--job` on a store: plan and choose on the snapshot's own tensors; `inspect --run-dir` finds the
    run's job and stores; `store ls --json`."""
    import torch

    import tenplex as tx
    from tenplex.ptc import PTC, ModelSpec
    from tenplex.ptc.model import Param
    from tenplex.runtime.hosts import EmulatedHosts
    from tenplex.runtime.record_types import Start
    from tenplex.runtime.records import Records
    from tenplex.store import StoreClient, start_store

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), *(torch.nn.Linear(8, 8) for _ in range(3)))
    with start_store() as sp:
        tx.save({"model": model, "step": 3}, job="snap", step=3, store=sp.url)
        on = ["--job", "snap", "--store", sp.url]
        d = json.loads(tenplex("plan", *on, "--to", "dp=2,pp=2", "--devices-per-host", "2", "--json").stdout)
        assert d["tensors"] == 7 and d["from"] == {"snapshot": "snap@3", "ranks": 1}
        assert d["bytes"]["total_state"] == sum(p.numel() * 4 for p in model.parameters())
        assert d["bytes"]["kept"] > 0 and len(d["assignment"]["devices"]) == 4
        r = tenplex("plan", *on, "--to", "tp=2")
        assert r.returncode == 2 and "does not say how its tensors split over tp" in r.stderr
        # the snapshot's tensors described with their tp split: tp planned on them
        ptc = PTC.from_json(StoreClient(sp.url).manifest("snap", 3)["ptc"])
        spec = ModelSpec.from_ptc(ptc)
        split = ModelSpec(
            tuple(Param(p.name, p.shape, p.dtype, 0, p.where) for p in spec.params), 4, 2, optimizer=False
        )
        r = tenplex("plan", *on, "--model", _describe(tmp_path, split), "--to", "tp=2", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["to"]["tp"] == 2, r.stderr
        c = json.loads(tenplex("choose", *on, "--devices", "4", "--json").stdout)
        assert {(e["dp"], e["tp"], e["pp"]) for e in c["ranking"]} == {(4, 1, 1), (2, 1, 2), (1, 1, 4)}
        # a run directory as `tenplex run` writes it
        run = tmp_path / "run"
        run.mkdir()
        hosts = EmulatedHosts(run)
        hosts.stores = {"h0": {"url": sp.url, "pid": sp.proc.pid}}
        hosts.save()
        timeline = Records(run / "timeline.jsonl")
        timeline.write(Start("snap", 3, [], {}))
        timeline.close()
        i = json.loads(tenplex("inspect", "--run-dir", str(run), "--json").stdout)
        assert i["job"] == "snap" and i["step"] == 3 and len(i["pieces"]) == 7
        r = tenplex("inspect", "--run-dir", str(tmp_path))
        assert r.returncode == 2 and "no cluster.json" in r.stderr
        ls = json.loads(tenplex("store", "ls", "--store", sp.url, "--json").stdout)
        assert [(v["job"], v["step"], v["committed"]) for v in ls["versions"]] == [("snap", 3, True)]
        ls = json.loads(tenplex("store", "ls", "--store", sp.url, "--blobs", "--json").stdout)
        assert len(ls["versions"][0]["blob_list"]) == 7
