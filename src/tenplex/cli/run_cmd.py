"""`tenplex run` and `tenplex demo`: the elastic runtime from the command line."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..ptc import PTCError
from ..runtime.runconfig import REFERENCE, REFERENCE_SNAPSHOT_EVERY, RunConfig
from ..train.config import TrainConfig
from ..util.flags import add_flags, from_args

if TYPE_CHECKING:
    from ..runtime.controller import Controller

# the training flags `tenplex run` takes; TrainConfig's others are the reference workload's defaults
TRAIN_FLAGS = ("model", "global_batch", "micro_batch", "seed", "lr", "warmup")


def _add_job_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, TrainConfig, only=TRAIN_FLAGS, defaults=REFERENCE)
    add_flags(p, RunConfig)


def _script(text: str | None) -> list[str] | None:
    """`train.py --lr 0.1` -> the script (checked to exist) and its arguments."""
    if not text:
        return None
    argv = shlex.split(text)
    if not argv or not Path(argv[0]).is_file():
        raise PTCError(f"--script {text!r}: no such file {argv[0] if argv else ''!r}")
    return [str(Path(argv[0]).resolve()), *argv[1:]]


def _table(path: str | None) -> dict | None:
    from ..runtime.tables import read_table

    return read_table(path, "para-config") if path else None


def _run_config(args: argparse.Namespace) -> RunConfig:
    from ..runtime.schedule import load_schedule

    script = _script(args.script)
    if args.network == "netns" and args.keep_stores:
        raise PTCError("--keep-stores needs loopback hosts: a namespace run removes its hosts when it ends")
    reference = not script  # its defaults; a script's own settings stand unless the command line sets them
    steps = args.steps or REFERENCE["steps"] if reference else args.steps
    snapshot_every = args.snapshot_every
    if reference and snapshot_every is None:
        snapshot_every = REFERENCE_SNAPSHOT_EVERY
    fixed = {k: v for k, v in REFERENCE.items() if k not in TRAIN_FLAGS}  # what run has no flag for
    train = from_args(TrainConfig, args, **{**fixed, "steps": args.steps or REFERENCE["steps"]})
    return from_args(
        RunConfig,
        args,
        train=train,
        schedule=load_schedule(args.schedule),
        steps=steps,
        run_dir=Path(args.run_dir or f"runs/{args.job}"),
        snapshot_every=snapshot_every,
        table=_table(args.table),
        script=script,
    )


def run(args: argparse.Namespace) -> int:
    from ..runtime.controller import Controller
    from ..runtime.exits import end_early, sigterm_as_interrupt, stop_hosts
    from ..runtime.validate import check_run

    cfg = _run_config(args)
    check_run(cfg)  # the whole schedule, before anything starts
    controller = None
    with sigterm_as_interrupt():
        try:
            controller = Controller(cfg)
            controller.run()
        except BaseException as e:  # each way out says what became of the stores
            code = end_early(controller, e)
            if args.whole_process:
                _exit_now(code)
            return code
    run_dir = cfg.run_dir
    if cfg.keep_stores:
        stores = controller.hosts.stores.items()
        print("stores left running: " + ", ".join(f"{h} {v['url']}" for h, v in stores)
              + f" (stop them: tenplex stop {run_dir})")  # fmt: skip
    else:
        stop_hosts(controller)
    ledger = _report(controller, run_dir)  # the reference workload always keeps one; a script may not
    return 1 if ledger is False or (ledger is None and not args.script) else 0


def _exit_now(code: int) -> None:
    """End the process once its lines are out, without the interpreter's teardown: after an early end the
    controller's threads and torch objects (stores, the standby pool's channels) may still be alive there,
    and torch aborted the process in it now and then ('terminate called without an active exception',
    exit -6 after the right output). Only where the command owns its process (`tenplex run` itself)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(controller: Controller, run_dir: Path) -> bool | None:
    """The summary, plot and report of a finished run; whether its data ledger holds (None: not kept)."""
    from ..runtime.report import plot, print_report, summary, write_json

    s = summary(run_dir)
    write_json(run_dir / "summary.json", s)
    png = plot(run_dir, run_dir / "timeline.png")
    print_report(s)
    print(f"timeline: {run_dir / 'timeline.jsonl'}  plot: {png}  summary: {run_dir / 'summary.json'}")
    if controller.durable:
        print(f"final state (PyTorch DCP): {controller.durable}")
    return s["ledger"]["ok"]


def demo(args: argparse.Namespace) -> int:
    from ..runtime.demo import run_demo

    started = time.time()
    ok = run_demo(Path(args.run_dir), args.model, args.steps, args.quiet, args.network, args.ahead)
    print(f"demo finished in {time.time() - started:.0f} s")
    return 0 if ok else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a training job under a resource schedule (scale, redeploy, failures)")
    _add_job_args(p)
    p.set_defaults(func=run)

    what = "the elastic demo job (about 30 s on 2 cores): dp, tp and pp changes, a redeploy, a failure"
    d = sub.add_parser("demo", help=f"{what}, then a static run to compare with")
    d.add_argument("--run-dir", default="runs/demo", help="where both runs, the plot and the summary go")
    d.add_argument("--steps", type=int, default=60, help="steps of the elastic and the static run")
    add_flags(d, TrainConfig, only=("model",))
    add_flags(d, RunConfig, only=("quiet", "network", "ahead"))
    d.set_defaults(func=demo)
