"""How `tenplex run` ends when it ends early: an error, ranks that keep crashing, an exception, Ctrl-C or
SIGTERM. Its ranks end with the controller (the standby pool's processes die with it). Its stores are kept
when they hold a committed snapshot of the job, which rerunning the same command resumes from, and one
line says so and how to stop them instead (`tenplex stop RUN_DIR`); with nothing to resume from they are
stopped, their shared memory with them, and the line says that.
"""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from .rundir import committed_step, live_stores, stop_stores

if TYPE_CHECKING:
    from .controller import Controller


class Terminated(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C is: the run ends through the same path (exit code 143, not 130)."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def stop_hosts(ctl: Controller) -> list[str]:
    """Stop every store of the run and wait until they are gone (their shared memory too)."""
    with ctl.hosts.lock:
        ctl.hosts.closed = True  # no store starts after this
    stopped = stop_stores(live_stores(ctl.cfg.run_dir))
    # the record: each is gone by now, so none is signalled twice (a store's second SIGTERM cut its
    # shutdown short and left its shared memory behind)
    ctl.hosts.shutdown()
    return stopped


def keep_or_stop(ctl: Controller) -> str:
    """Keep the stores when they hold a snapshot to resume from, else stop them; what was done, in words."""
    run_dir, job = ctl.cfg.run_dir, ctl.cfg.job
    stores = live_stores(run_dir)
    step = committed_step(job, stores) if stores and ctl.cfg.network != "netns" else None
    if step is None:
        stop_hosts(ctl)
        return "stopped its ranks and stores (no snapshot to resume from)"
    return (
        f"kept {len(stores)} stores holding job {job} at step {step} for a resume: run the same command "
        f"again to resume, or `tenplex stop {run_dir}` to stop them"
    )


def end_early(ctl: Controller | None, error: BaseException) -> int:
    """Print what became of the run's stores (one line); the exit code, or a `TenplexError` (the CLI prints
    it as one line) or `SystemExit` raised on. Anything else is a bug: its traceback, as Python prints one,
    and exit code 1, returned rather than raised: an exception left to the interpreter keeps the run's
    objects alive into its teardown, where torch's threads could abort the process ('terminate called
    without an active exception', exit -6 for 1)."""
    from ..ptc import TenplexError
    from .controller import JobFailed

    line = keep_or_stop(ctl) if ctl is not None else "nothing was started"
    if isinstance(error, KeyboardInterrupt):
        sig = "terminated (SIGTERM)" if isinstance(error, Terminated) else "interrupted"
        print(f"tenplex run: {sig}; {line}", file=sys.stderr)
        return 143 if isinstance(error, Terminated) else 130
    if isinstance(error, JobFailed):
        print(f"tenplex run: {error}", file=sys.stderr)
        print(f"tenplex run: {line}", file=sys.stderr)
        return 1
    print(f"tenplex run: {line}", file=sys.stderr)
    if isinstance(error, (TenplexError, SystemExit)):
        raise error
    traceback.print_exception(error)
    return 1
