"""What is asked of a running agent job from outside, through its rendezvous store: a host's devices
(`tenplex devices`), the job's layout (`tenplex layout`), its end (`tenplex stop`) and the step at which
the next planned change lands (`--at-step`). One place for the keys: the CLI writes them, the agents read
them at each look (`runtime/agent.py`)."""

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


def ask_devices(base: dist.Store, run_id: str, store_url: str, devices: list[int]) -> None:
    put(base, job_key(run_id, "devices", store_url), ",".join(map(str, devices)))


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
