"""Who left an agent job and who was lost, as one agent sees it from round to round: the next round's
expected size (so torch's rendezvous need not wait out its last call for members that will not come), the
stores of lost hosts and of hosts that left and stopped them (a load counts them lost without asking), and
which members' stores refuse at once after a round broke (their hosts are gone)."""

from __future__ import annotations

import errno
import socket
from urllib.parse import urlsplit

import torch.distributed as dist

from .channel import put
from .rounds import has, job_key


def refuses(url: str, timeout: float = 0.3) -> bool:
    """Whether the store's address answers at once that nothing is there: connection refused (no process
    listens), or host or network unreachable (its route withdrawn, its ARP unanswered). A timeout says
    nothing: a slow host is not a lost one."""
    where = urlsplit(url)
    try:
        socket.create_connection((where.hostname, where.port or 80), timeout=timeout).close()
    except OSError as e:
        return e.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)
    return False


class Membership:
    """The stores of the round before, its number, and the stores of hosts lost (not left) so far."""

    def __init__(self, run_id: str, own: str) -> None:
        self.run_id, self.own = run_id, own
        self.last_stores: list[str] = []
        self.last_round = 0
        self.gone: set[str] = set()

    def expected(self, base: dist.Store | None, waiting: int) -> int | None:
        """The next round's size: the last round's members, less those that left as planned or were found
        lost in it, plus the `waiting` nodes (None: the first round)."""
        if base is None or not self.last_stores:
            return None
        left = [
            url
            for url in self.last_stores
            if url != self.own
            and (
                has(base, job_key(self.run_id, "left", url))
                or has(base, job_key(self.run_id, "lost", self.last_round, url))
            )
        ]
        return len(self.last_stores) - len(left) + waiting

    def formed(self, base: dist.Store, number: int, stores: list[str]) -> None:
        """Round `number` formed with `stores`: the last round's hosts not in it that did not leave as
        planned were lost, so a load counts their stores lost without waiting on them (a store that left
        stays a source to ask: it may hold the only copy of its shards until they are loaded)."""
        for url in self.last_stores:
            if url not in stores and not has(base, job_key(self.run_id, "left", url)):
                self.gone.add(url)
                put(base, job_key(self.run_id, "gone", url), str(number))  # for agents that join later
        for url in self.gone & set(stores):  # a store back on its port is a new incarnation: asked again
            base.delete_key(job_key(self.run_id, "gone", url))
        self.gone -= set(stores)
        self.last_stores, self.last_round = list(stores), number

    def retired(self, base: dist.Store, urls: list[str], stores: list[str]) -> list[str]:
        """The stores among `urls`, not back in `stores`, that the job knows are gone, whoever saw it: a
        lost host's (`gone/URL`, written where it was found), and a host's that left as planned once its
        next round loaded (its agent stopped it then, `Agent._leave`). A load counts them lost without
        asking: an agent that joined after it happened knows it too, and a port where nothing listens
        would cost each ask the store transport's retries (a second)."""
        key = job_key(self.run_id, "loaded")
        loaded = int(base.get(key)) if has(base, key) else 0
        out = []
        for url in urls:
            left, gone = job_key(self.run_id, "left", url), job_key(self.run_id, "gone", url)
            stopped = has(base, left) and loaded > int(base.get(left))
            if url not in stores and (has(base, gone) or stopped):
                out.append(url)
        return out

    def refused(self, stores: list[str]) -> list[int]:
        """The members (by node) whose store refuses at once: their hosts' processes are gone."""
        return [i for i, url in enumerate(stores) if url != self.own and refuses(url)]
