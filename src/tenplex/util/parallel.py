"""Calls to several stores at once."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def each(fn: Callable[[T], R], items: Iterable[T], limit: int = 32) -> list[R]:
    """`fn` of every item, at most `limit` at once, in the items' order; the first error is raised once all
    have ended. Why: each call is a round trip to another store (on other hosts, a network's), so asked in
    turn they cost the sum of the round trips, asked at once the longest one."""
    todo = list(items)
    if len(todo) <= 1:  # no thread to start and join: what a small load's one request mostly cost
        return [fn(x) for x in todo]
    with ThreadPoolExecutor(max_workers=min(limit, len(todo))) as pool:
        futures = [pool.submit(fn, x) for x in todo]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]
