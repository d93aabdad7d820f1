"""Flags derived from configuration dataclasses (`tenplex.util.flags`): each default and help text is
written once, on the field, and the parsers of `tenplex train`, `run` and `agent` are built from them."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from tenplex.cli.main import build_parser
from tenplex.runtime.agentconfig import AgentConfig
from tenplex.runtime.runconfig import REFERENCE, RunConfig
from tenplex.train.config import TrainConfig
from tenplex.util.flags import add_flags, flag, flagged, from_args, size

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Toy:
    target: str = flag(help="what to run", names=("target",))
    rest: list[str] = flag(
        help="its arguments", names=("rest",), nargs=argparse.REMAINDER, default_factory=list
    )
    count: int = flag(3, "how many")
    rate: float | None = flag(None, "how fast")
    loud: bool = flag(False, "say more")
    warm: bool = flag(True, "start cold", names=("--cold",), action="store_false")
    mode: str = flag("a", "which mode", names=("--mode", "--the_mode"), choices=("a", "b"), dest="the_mode")
    memory: int | None = flag(None, "how much", type=size)
    paths: list[str] = flag(help="where (repeat)", names=("--path",), action="append", default_factory=list)
    every: int | None = flag(5, "how often (default: 5, or the target's own)", cli_default=None)
    hidden: int = 7  # not a flag


def _parser(**kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, Toy, **kw)
    return p


def test_a_dataclass_round_trips_through_its_flags():
    args = _parser().parse_args(
        [
            *("--count", "4", "--rate", "0.5", "--loud", "--cold", "--the_mode", "b", "--memory", "2KiB"),
            *("--path", "x", "--path", "y", "--every", "2", "run.py", "--count", "9"),
        ]
    )
    assert args.the_mode == "b" and not hasattr(args, "mode")  # an older dest is kept
    toy = from_args(Toy, args)
    assert toy == Toy("run.py", ["--count", "9"], 4, 0.5, True, False, "b", 2048, ["x", "y"], 2, 7)


def test_a_flag_not_given_is_the_fields_default_unless_the_command_line_says_otherwise():
    toy = from_args(Toy, _parser().parse_args(["run.py"]))
    assert toy == dataclasses.replace(Toy("run.py"), every=None)  # cli_default: "not given"
    assert from_args(Toy, _parser().parse_args(["run.py"]), every=5, hidden=1) == Toy("run.py", hidden=1)
    # `only`, `exclude`, `defaults`: a command takes some flags, with its own values
    p = argparse.ArgumentParser()
    add_flags(p, Toy, only=("count", "rate", "loud"), exclude=("loud",), defaults={"count": 8})
    assert vars(p.parse_args([])) == {"count": 8, "rate": None}
    assert from_args(Toy, p.parse_args([]), target="t") == Toy("t", count=8)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--count", "x"], "invalid int value"),
        (["--mode", "c"], "invalid choice"),
        (["--memory", "lots"], "--memory"),
    ],
)
def test_a_bad_value_is_a_usage_error(argv, words):
    with pytest.raises(argparse.ArgumentError, match=words):
        _parser().parse_args([*argv, "run.py"])


def _sub(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _defaults(p: argparse.ArgumentParser) -> dict[str, object]:
    """Each option's default, by its first spelling."""
    return {a.option_strings[0]: a.default for a in p._actions if a.option_strings}


@pytest.mark.parametrize(
    ("command", "cls", "values"),
    [
        ("train", TrainConfig, {}),
        ("run", TrainConfig, REFERENCE),  # the reference workload: one override, what --help shows
        ("run", RunConfig, {}),
        ("agent", AgentConfig, {}),
        ("status", AgentConfig, {}),
    ],
)
def test_every_command_default_is_its_fields(command, cls, values):
    """No flag re-declares a default: each parser's is the field's (or the command's one override)."""
    shown, checked = _defaults(_sub(command)), 0
    for f in flagged(cls):
        meta = f.metadata["tenplex.flag"]
        name = (meta["names"] or (f"--{f.name.replace('_', '-')}",))[0]
        if name not in shown or (cls is TrainConfig and command == "run" and f.name == "steps"):
            continue  # not a flag of this command; run's --steps is RunConfig's
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        expected = meta["kw"].get("default", values.get(f.name, default))
        assert shown[name] == (None if expected is dataclasses.MISSING else expected), (command, f.name)
        checked += 1
    assert checked >= 2, command


def test_run_and_demo_train_the_reference_workload_train_its_own_defaults():
    args = build_parser().parse_args(["run", "--schedule", "s.yaml"])
    assert (
        (args.lr, args.warmup)
        == (REFERENCE["lr"], REFERENCE["warmup"])
        != (TrainConfig.lr, TrainConfig.warmup)
    )
    args = build_parser().parse_args(["train"])
    assert from_args(TrainConfig, args) == TrainConfig()
    # run's namespace holds both classes' flags: only `steps` is in both, and run sets TrainConfig's itself
    run_flags = {f.metadata["tenplex.flag"]["kw"].get("dest", f.name) for f in flagged(RunConfig)}
    assert run_flags & {f.name for f in dataclasses.fields(TrainConfig)} == {"steps"}
    demo = (ROOT / "src/tenplex/runtime/demo.py").read_text()
    assert "**REFERENCE" in demo and "lr=" not in demo  # the demo's values come from the same place


def _documented() -> list[tuple[list[str], set[str]]]:
    """(command path, flags) for each command the table of docs/cli.md shows, e.g. (["store", "ls"], ...)."""
    text = (ROOT / "docs" / "cli.md").read_text()
    out = []
    for row in re.findall(r"^\| (`tenplex .*?) \|", text, re.M):
        for usage in re.findall(r"`(tenplex [^`]*)`", row):
            words = usage.split()[1:]
            path = [w for w in words[:2] if re.fullmatch(r"[a-z][a-z0-9]*", w)]
            out.append((path, set(re.findall(r"--[a-z][a-z-]*", usage))))
    return out


def test_the_flags_docs_cli_lists_are_the_parsers():
    documented = _documented()
    assert len(documented) >= 15 and documented[1][0] == ["run"]
    assert {"--schedule", "--steps", "--no-ahead", "--fresh"} <= documented[1][1]
    missing = []
    for path, flags in documented:
        p = _sub(path[0])
        for word in path[1:]:
            sub = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
            p = sub[0].choices[word] if sub and word in sub[0].choices else p
        known = {o for a in p._actions for o in a.option_strings}
        missing += [f"tenplex {' '.join(path)} {f}" for f in sorted(flags - known)]
    assert not missing, "docs/cli.md names flags the parser lacks:\n" + "\n".join(missing)
