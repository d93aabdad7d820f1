"""A worker kept by `tenplex agent`: one process that runs the training script once per round.

    python -m tenplex.runtime.worker SCRIPT ARGS...      (or -m MODULE ARGS...; the agent starts it)

A membership change costs torchrun a new interpreter, a torch import, the user's imports and a CUDA
context per worker. Here the process, its imports and its device stay: the agent hands each round's rank,
world size and master address through its store (`rounds.Round`), the worker sets the torchrun-style
variables and runs the script's `__main__` anew (a fresh namespace: the script rebuilds its model for the
new world and `tenplex.load`s into it), and when the round ends (`job.running` said stop, or a collective
broke because a host was lost) it destroys its process group and waits for the next round. Modules the
script imported stay imported between rounds, as under any in-process restart.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import time
import traceback
from datetime import timedelta

from ..util.collector import freeze_imports
from .channel import put
from .preload import preload
from .rounds import AgentError, Round, agent_store, ended_at_last_step, forget_end, has, worker_agent

COMMIT_GRACE_S = 2.0
# after a round broke (a collective failed: a host was lost), briefly: the commit under way most likely
# waits on the dead, and this worker's process group stays open meanwhile, so the ranks whose collective
# waits on this one (a ring's neighbours of the dead, say) stay stuck in it until the group is destroyed
BROKEN_GRACE_S = 0.3
WAIT_S = 7 * 24 * 3600.0  # a worker waits this long for its next command (the agent ends it sooner)


def run_target(target: list[str]) -> tuple[str, str]:
    """Run the script (or `-m module`) once as `__main__`: ("done" | "error", message)."""
    module = target[0] == "-m"
    path = target[1] if module else target[0]
    sys.argv = [path, *target[2 if module else 1 :]]
    try:
        if module:
            runpy.run_module(path, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            return "error", f"exit code {e.code}"
    except BaseException as e:  # the worker reports it and waits for the next round
        traceback.print_exc()
        return "error", f"{type(e).__name__}: {e}"[:2000]
    return "done", ""


def clear_round(grace: float = COMMIT_GRACE_S) -> None:
    """Forget the round's process groups and what is cached per group or mesh, so the next round's
    script starts on a clean slate in this process."""
    import torch.distributed as dist

    from ..train.parallel import forget_meshes
    from ..transformer.save import forget_groups, wait_for_pending

    # a snapshot's commit under way is let finish, briefly: in a round broken by a lost host it may wait on
    # the dead; left torn, it is never loaded (docs/consistency.md), and its thread ends on its own timeouts
    wait_for_pending(grace)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may not tear down cleanly; it is dropped anyway
            pass
    forget_groups()
    forget_meshes()


def serve(target: list[str]) -> int:
    placed = worker_agent()
    if placed is None:
        print("tenplex worker: start me with `tenplex agent` ($TENPLEX_AGENT is not set)", file=sys.stderr)
        return 2
    _, inbox = placed
    store = agent_store()
    assert store is not None
    store.set_timeout(timedelta(seconds=WAIT_S))
    preload()  # what the script would import after the round formed, before this host joins
    freeze_imports()
    put(store, f"warm/{inbox}", "1")
    n = 0
    while True:
        store.wait([f"cmd/{inbox}/{n}"])
        cmd = json.loads(store.get(f"cmd/{inbox}/{n}"))
        n += 1
        if cmd["kind"] == "exit":
            return 0
        rnd, slot = Round.from_json(cmd["round"]), int(cmd["slot"])  # its device, for this process's life
        os.environ.update(rnd.environ(int(cmd["position"]), slot, int(cmd["local_world"])))
        started = time.time()
        forget_end()
        outcome, message = run_target(target)
        if outcome == "error":  # the agent hears of it now, not after the teardown: the next round forms
            put(store, f"broke/{rnd.number}/{slot}", message)  # while this process still cleans up
        clear_round(BROKEN_GRACE_S if outcome == "error" else COMMIT_GRACE_S)
        reached = ended_at_last_step()
        if outcome == "done" and (not reached if reached is not None else has(store, f"stop/{rnd.number}")):
            outcome = "stopped"  # the round ended for a change, not because the job is done
        record = {"outcome": outcome, "error": message, "started": started, "ended": time.time()}
        put(store, f"parked/{rnd.number}/{slot}", json.dumps(record))
        sys.stdout.flush()
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    target = list(sys.argv[1:] if argv is None else argv)
    if not target or target == ["-m"]:
        print("usage: python -m tenplex.runtime.worker SCRIPT ARGS... | -m MODULE ARGS...", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's to handle (a planned leave)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: where a worker waits
    try:
        return serve(target)
    except AgentError as e:
        print(f"tenplex worker: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the agent's store went away: the agent is gone, and so is this worker
        print(f"tenplex worker: lost the agent: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
