"""Which connections a store serves: authenticated ones up to a cap in all and per peer address, and
connections not authenticated yet in a small budget of their own, where a newcomer past the budget
displaces the oldest one of the address that holds the most (so a flood of them never takes the room of
authenticated ones). The caller (`server.Server`) holds its lock around every call."""

from __future__ import annotations

from collections import Counter

from .errors import StoreUnavailable
from .request import Session


class Admission:
    """The pools of connections: `Session.pool` says which one a session is counted in ("" for none)."""

    def __init__(self, max_authed: int, max_unauth: int, max_unauth_per_peer: int) -> None:
        self.max_authed = max_authed
        self.max_per_peer = max(4, max_authed * 3 // 4)
        self.max_unauth, self.max_unauth_per_peer = max_unauth, max_unauth_per_peer
        self._peers: Counter[str] = Counter()  # authenticated connections by peer
        self._authed = 0
        self._unauth: dict[str, dict[Session, None]] = {}  # by peer, oldest first
        self.unauthenticated = 0

    def _room(self, s: Session) -> bool:
        return self._authed < self.max_authed and self._peers[s.peer] < self.max_per_peer

    def enter(self, s: Session) -> Session | None:
        """Put `s` in its pool (its `pool` stays "" when full); the connection it displaces, taken out of
        its pool already."""
        if s.authed:
            if self._room(s):
                self._count_authed(s)
            return None
        mine = self._unauth.setdefault(s.peer, {})
        victim = None
        if len(mine) >= self.max_unauth_per_peer:
            victim = next(iter(mine))
        elif self.unauthenticated >= self.max_unauth:
            victim = next(iter(max(self._unauth.values(), key=len)))
        if victim is not None:
            self.leave(victim)
        self._unauth.setdefault(s.peer, {})[s] = None
        self.unauthenticated += 1
        s.pool = "unauth"
        return victim

    def _count_authed(self, s: Session) -> None:
        self._authed += 1
        self._peers[s.peer] += 1
        s.authed, s.pool = True, "auth"

    def leave(self, s: Session) -> None:
        """Take `s` out of the pool it is counted in."""
        if s.pool == "auth":
            self._authed -= 1
            self._peers[s.peer] -= 1
            if self._peers[s.peer] <= 0:
                del self._peers[s.peer]
        elif s.pool == "unauth":
            mine = self._unauth[s.peer]
            del mine[s]
            if not mine:
                del self._unauth[s.peer]
            self.unauthenticated -= 1
        s.pool = ""

    def promote(self, s: Session) -> None:
        """`s` proved it holds the token: into the authenticated pool (StoreUnavailable when that is full,
        or when `s` was displaced meanwhile)."""
        if s.pool == "auth":
            return
        if s.pool != "unauth" or not self._room(s):
            raise StoreUnavailable("too many connections")
        self.leave(s)
        self._count_authed(s)
