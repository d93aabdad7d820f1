"""Torch's elastic rendezvous as an agent uses it: its handler with the agent's defaults, its pace, its exit.

Membership stays torch's (`DynamicRendezvousHandler` over c10d or etcd): who is in a round, when a round
forms, when a silent node is dropped. The agent only picks shorter defaults than torchrun's (its rounds
re-form in process, not by restarting worker groups), reads the state faster while a round forms, and
takes a leaving node out of the round at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..util import logs
from .rounds import AgentError

log = logs.get("agent")

# c10d settings unless --rdzv-conf says otherwise: torch's defaults (30 s last call, 5 s x 3 heartbeats)
# are made for restarting whole worker groups; here a round forms as soon as its members are there
DEFAULTS = {
    "last_call_timeout": "1",
    "keep_alive_interval": "1",
    "keep_alive_max_attempt": "3",
    "join_timeout": "600",
}
POLL_S = 0.1  # how often a joining agent reads the rendezvous state (torch: every 1 s; see `quicken`)


@dataclass(frozen=True)
class Settings:
    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str
    conf: dict[str, str]


def handler(s: Settings) -> tuple[Any, float]:
    """Torch's handler for this job, and how long a member may be silent before it counts as lost (as long
    as torch's rendezvous takes to drop a node: its heartbeat interval times its attempts)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # each round's rank 0 worker hosts its group
    conf = {**(DEFAULTS if s.backend == "c10d" else {}), **s.conf}
    poll = float(conf.pop("poll_interval", POLL_S))
    silent = max(
        2.0, float(conf.get("keep_alive_interval", "5")) * float(conf.get("keep_alive_max_attempt", "3"))
    )
    params = RendezvousParameters(
        s.backend, s.endpoint, s.run_id, s.min_nodes, s.max_nodes, local_addr=s.local_addr, **conf
    )
    try:
        h = get_rendezvous_handler(params)
    except Exception as e:  # torch raises many kinds; the user gets one line
        raise AgentError(f"rendezvous {s.backend} at {s.endpoint}: {e}") from None
    quicken(h, poll)
    return h, silent


def quicken(h: Any, poll: float) -> None:
    """Let torch's rendezvous read its state every `poll` s while a round forms, not every second, so a
    round forms a poll after its last member joins rather than up to two seconds later (the reads are one
    small get on the rendezvous store each; `benchmarks/bench_agent.py` measures the joins). The rounds,
    their rules and timeouts stay torch's; this changes only the pace of the join loop's polls (`_delay`)
    and of the state cache behind them. Private names of torch 2.13: when they are gone, the agent runs at
    torch's own pace, with a notice."""
    if poll >= 1.0:
        return
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

        h._state_holder._cache_duration = 0
        if not getattr(dr._delay, "tenplex_poll", None):
            torch_delay = dr._delay

            def delay(seconds: float | tuple[float, float]) -> None:
                torch_delay(min(seconds, poll) if isinstance(seconds, (int, float)) else seconds)

            delay.tenplex_poll = poll  # type: ignore[attr-defined]
            dr._delay = delay
    except AttributeError as e:
        log.warning("torch's rendezvous polls at its own pace (1 s): %s", e)


@contextlib.contextmanager
def expecting(h: Any, nodes: int | None) -> Iterator[None]:
    """Form the next round as soon as `nodes` members joined, not a last call later: after a planned leave
    or a loss every remaining agent knows who the next round has (the last round's members, less those that
    left or were found lost, plus those waiting). torch completes a round when it reaches its maximum size,
    else at the last call's deadline; for this one round the maximum this agent applies is `nodes`. An
    unexpected joiner keeps its own maximum (it completes the round at the deadline, as before, or waits
    for the next round); a member expected but gone leaves the deadline as the rule. Private names of torch
    2.13 (`_settings`, frozen): when they are gone, rounds form at torch's own pace."""
    settings = getattr(h, "_settings", None)
    usual = getattr(settings, "max_nodes", None)
    if nodes is None or usual is None or not settings.min_nodes <= nodes < usual:
        yield
        return
    object.__setattr__(settings, "max_nodes", nodes)
    try:
        yield
    finally:
        object.__setattr__(settings, "max_nodes", usual)


def leave(h: Any) -> None:
    """Take this node out of the round's participants at once, so the others form their next round
    without waiting for its heartbeats to expire (torch has no public call for it: its exit operation,
    else the expiry)."""
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        h._stop_heartbeats()
        h._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10)
    except Exception as e:  # not a DynamicRendezvousHandler, or the store is gone
        log.warning("left the rendezvous without telling it (%s); the others wait for the heartbeats", e)


def drop(h: Any, ranks: set[int]) -> None:
    """Take the members of the last round at `ranks` out of the rendezvous now, as torch does once their
    heartbeats lapse: their hosts were found gone (`Agent._mark_refused`), and the next round would
    otherwise wait out their heartbeats (seconds) before it can form. Their last heartbeats are set long
    expired; torch's own sanitizing removes them at the next read of the state. A member that lives after
    all joins the next round as any newcomer does. Private names of torch 2.13: when they are gone, the
    heartbeats decide, with a notice."""
    long_ago = datetime(1970, 1, 1, tzinfo=UTC)
    tries = iter(range(5))  # a write that lost a race with another node's is made again on the fresh state

    def op(ctx: Any, deadline: float) -> Any:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _Action

        gone = [n for n, r in ctx.state.participants.items() if r in ranks and n != ctx.node]
        if not gone or next(tries, None) is None:
            return _Action.FINISH
        for node in gone:
            ctx.state.last_heartbeats[node] = long_ago
        return _Action.KEEP_ALIVE  # this node's own heartbeat, and the state written back

    try:
        with h._heartbeat_lock:
            h._op_executor.run(op, time.monotonic() + 10)
    except Exception as e:  # not a DynamicRendezvousHandler, or the store is gone
        log.warning("members %s stay in the rendezvous until their heartbeats lapse (%s)", sorted(ranks), e)
