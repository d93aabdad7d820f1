"""`tenplex run` and `tenplex demo`: the elastic runtime from the command line."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..ptc import PTCError
from ..train.config import TrainConfig
from .args import size_arg

if TYPE_CHECKING:
    from ..runtime.controller import Controller
    from ..runtime.runconfig import RunConfig

REFERENCE_STEPS = 50  # the reference workload's run length and snapshot interval, unless given
REFERENCE_SNAPSHOT_EVERY = 5


def _train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        global_batch=args.global_batch,
        micro_batch=args.micro_batch,
        seed=args.seed,
        lr=args.lr,
        warmup=args.warmup,
        steps=args.steps or REFERENCE_STEPS,
        device="cpu",
    )


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="GPT preset of the reference workload (tiny, small, base, "
                   "...); with --script it only guides the checks of forced layouts")  # fmt: skip
    p.add_argument("--steps", type=int, help=f"steps to train (default: {REFERENCE_STEPS}; with --script, "
                   "the script's own ElasticJob(until=...), which this replaces, saying so)")  # fmt: skip
    p.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step, split over dp")
    p.add_argument("--micro-batch", type=int, default=0, help="samples per pipeline micro-batch (0: the "
                   "global batch over dp)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the model, the sample order and dropout")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate")
    p.add_argument("--warmup", type=int, default=5, help="steps of linear learning-rate warm-up")
    p.add_argument("--devices-per-host", type=int, default=2, help="devices of each emulated host")
    every = REFERENCE_SNAPSHOT_EVERY
    p.add_argument("--snapshot-every", type=int, help="asynchronous in-memory snapshot every N steps, 0: "
                   f"never (default: {every}; with --script, the script's own ElasticJob(snapshot_every=...),"
                   " which this replaces, saying so)")  # fmt: skip
    p.add_argument("--para-config", metavar="TABLE", help="JSON or YAML table devices -> {dp, tp, pp} that "
                   "overrides the chooser")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no live view, only the report at the end")
    _add_ahead_arg(p)


def _add_ahead_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-ahead", dest="ahead", action="store_false",
                   help="start a planned change's ranks only once the old layout stopped (default on CPUs: "
                   "while it trains, so that they are built and warm when it stops)")  # fmt: skip


def _add_network_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--network",
        choices=("loopback", "netns"),
        default="loopback",
        help="emulated hosts as loopback stores or network namespaces (root; docs/netns.md)",
    )
    p.add_argument("--nic-gbps", type=float, help="netns: each host's NIC, each way (default: unshaped)")
    p.add_argument("--nic-latency-ms", type=float, help="netns: added latency per host link (needs netem)")
    p.add_argument("--replicas", type=int, default=0, help="netns: copies of each snapshot on the next hosts")


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
    from ..runtime.runconfig import RunConfig
    from ..runtime.schedule import load_schedule

    script = _script(args.script)
    if args.network == "netns" and args.keep_stores:
        raise PTCError("--keep-stores needs loopback hosts: a namespace run removes its hosts when it ends")
    reference = not script  # its defaults; a script's own settings stand unless the command line sets them
    return RunConfig(
        _train_config(args),
        load_schedule(args.schedule),
        args.steps or REFERENCE_STEPS if reference else args.steps,
        Path(args.run_dir or f"runs/{args.job}"),
        job=args.job,
        devices_per_host=args.devices_per_host,
        snapshot_every=REFERENCE_SNAPSHOT_EVERY
        if reference and args.snapshot_every is None
        else args.snapshot_every,
        table=_table(args.para_config),
        quiet=args.quiet,
        script=script,
        network=args.network,
        nic_gbps=args.nic_gbps,
        nic_latency_ms=args.nic_latency_ms,
        replicas=args.replicas,
        store_memory=args.store_memory,
        ahead=args.ahead,
        fresh=args.fresh,
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
            return end_early(controller, e)
    run_dir = cfg.run_dir
    if args.keep_stores:
        stores = controller.hosts.stores.items()
        print("stores left running: " + ", ".join(f"{h} {v['url']}" for h, v in stores)
              + f" (stop them: tenplex stop {run_dir})")  # fmt: skip
    else:
        stop_hosts(controller)
    ledger = _report(controller, run_dir)  # the reference workload always keeps one; a script may not
    return 1 if ledger is False or (ledger is None and not args.script) else 0


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
    p.add_argument("--schedule", required=True, help="the resource schedule: a JSON or YAML list of events "
                   "(docs/runtime.md), checked whole before the first step")  # fmt: skip
    p.add_argument(
        "--script",
        metavar='"TRAIN.PY ARGS"',
        help="run your own training script (it uses tenplex.ElasticJob) instead of the reference workload; "
        "the script lays itself out",
    )
    p.add_argument(
        "--job", default="tenplex-job", help="the job's name in the stores (a script's own is replaced)"
    )
    p.add_argument(
        "--keep-stores",
        action="store_true",
        help="leave the emulated hosts' stores running after the job (for tenplex inspect / store ls)",
    )
    p.add_argument("--run-dir", help="where the timeline, plot and the stores' record go (default: "
                   "runs/JOB); the same one again resumes")  # fmt: skip
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start over from step 0 when the stores of an earlier run of this --run-dir are lost (without "
        "it such a rerun stops with the lost stores named, so no snapshot is thrown away unasked)",
    )
    p.add_argument("--store-memory", type=size_arg, metavar="SIZE",
                   help="the memory limit of every host's store, e.g. 512MiB (default 8GiB); a snapshot "
                   "that does not fit is skipped, with a warning")  # fmt: skip
    _add_job_args(p)
    _add_network_args(p)
    p.set_defaults(func=run)

    what = "the elastic demo job (about 30 s on 2 cores): dp, tp and pp changes, a redeploy, a failure"
    d = sub.add_parser("demo", help=f"{what}, then a static run to compare with")
    d.add_argument("--run-dir", default="runs/demo", help="where both runs, the plot and the summary go")
    d.add_argument("--model", default="tiny", help="GPT preset (tiny, small, base, ...)")
    d.add_argument("--steps", type=int, default=60, help="steps of the elastic and the static run")
    d.add_argument("--quiet", action="store_true", help="no live view, only the report at the end")
    d.add_argument("--network", choices=("loopback", "netns"), default="loopback",
                   help="the elastic run's hosts as network namespaces (root)")  # fmt: skip
    _add_ahead_arg(d)
    d.set_defaults(func=demo)
