"""What is asked of a running agent job from outside, through its rendezvous store: a host's devices
(`tenplex devices`), the job's layout (`tenplex layout`), its end (`tenplex stop`), the step at which
the next planned change lands (`--at-step`) and the warm spares let in (`tenplex admit`). One place for
the keys: the CLI writes them, the agents read them at each look (`runtime/agent.py`)."""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from ..ptc import TenplexError
from ..util import logs
from .agentconfig import parse_devices
from .channel import put
from .rounds import has, job_key

log = logs.get("agent")


def ask_devices(
    base: dist.Store, run_id: str, store_url: str, devices: list[int], failed: list[int] | None = None
) -> None:
    """The host's devices become `devices`; `failed`: those left out failed, their workers are killed at
    the agent's next look (the job recovers without them), not stopped at a step boundary."""
    put(base, job_key(run_id, "devices", store_url), ",".join(map(str, devices)))
    if failed:  # after the devices: an agent that acts on it finds the devices to go on with
        n = base.add(job_key(run_id, "failures", store_url), 1)
        put(base, job_key(run_id, "failed", store_url), json.dumps({"devices": failed, "n": n}))


def failed_devices(base: dist.Store, run_id: str, store_url: str) -> tuple[list[int], int]:
    """The devices of the host of `store_url` last said failed, and how many times devices were said
    failed there (0: never); an agent acts on a count it has not seen."""
    key = job_key(run_id, "failed", store_url)
    if not has(base, key):
        return [], 0
    said = json.loads(base.get(key))
    return [int(d) for d in said["devices"]], int(said["n"])


def asked_devices(base: dist.Store, run_id: str, store_url: str) -> list[int] | None:
    """The devices asked for the host of `store_url` (None: never, or nothing an agent can take)."""
    key = job_key(run_id, "devices", store_url)
    if not has(base, key):
        return None
    try:
        return parse_devices(base.get(key).decode())
    except TenplexError as e:
        log.warning("ignoring %s: %s", key, e)
        return None


def ask_layout(base: dist.Store, run_id: str, layout: str) -> None:
    """`layout` as `dp=2,tp=2,pp=1`; "" for none (each world chooses its own)."""
    put(base, job_key(run_id, "layout"), layout)


def asked_layout(base: dist.Store, run_id: str) -> str:
    key = job_key(run_id, "layout")
    return base.get(key).decode() if has(base, key) else ""


def ask_stop(base: dist.Store, run_id: str) -> None:
    put(base, job_key(run_id, "stop"), json.dumps({"time": time.time()}))


def stop_asked(base: dist.Store, run_id: str) -> bool:
    return has(base, job_key(run_id, "stop"))


def ask_at(base: dist.Store, run_id: str, step: int | None) -> None:
    """The job's planned changes (a host joining or leaving, devices, layout, a stop) land at `step`: the
    round trains to it, saves it and ends there; None: at the next step boundary. Written before the ask
    it goes with, so no agent sees the ask without it."""
    key = job_key(run_id, "at")
    if step is None:
        base.delete_key(key)
    else:
        put(base, key, str(step))


def asked_at(base: dist.Store, run_id: str) -> int | None:
    key = job_key(run_id, "at")
    return int(base.get(key)) if has(base, key) else None


def offer(base: dist.Store, run_id: str, store_url: str, waiting: bool) -> None:
    """A standby agent (`--standby`) says it waits, warm, to join (or that it no longer does)."""
    key = job_key(run_id, "standby", store_url)
    if waiting:
        put(base, key, "1")
        put(base, job_key(run_id, "spare", base.add(job_key(run_id, "spares"), 1) - 1), store_url)
    else:
        base.delete_key(key)


def waits(base: dist.Store, run_id: str, store_url: str) -> bool:
    return has(base, job_key(run_id, "standby", store_url))


def spares(base: dist.Store, run_id: str) -> list[str]:
    """The store URLs of the standby agents that wait, warm, to be let in (`tenplex status` lists them)."""
    keys = [job_key(run_id, "spare", i) for i in range(base.add(job_key(run_id, "spares"), 0))]
    urls = dict.fromkeys(base.get(k).decode() for k in keys if has(base, k))
    return [u for u in urls if waits(base, run_id, u)]


def admit(base: dist.Store, run_id: str, store_url: str) -> None:
    put(base, job_key(run_id, "admit", store_url), "1")


def admitted(base: dist.Store, run_id: str, store_url: str) -> bool:
    """Whether the standby agent at `store_url` was let in; the word is taken (a later standby agent on
    the same store waits for its own)."""
    key = job_key(run_id, "admit", store_url)
    if not has(base, key):
        return False
    base.delete_key(key)
    return True
