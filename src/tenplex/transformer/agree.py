"""Every rank learns every rank's failure: the one way a save's or a load's ranks decide together.

As DCP's `_DistWrapper` does for its steps: each rank runs its part and catches what it raises, the ranks
gather who failed and why, and every rank takes the same way out (raise, fall back, try another snapshot),
so none waits at a later collective for a rank that gave up. The failure travels as a small description
(kind, whether the stores are to blame, one line), never the exception object, which need not unpickle on
another rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import world
from .errors import StateError

OUTCOME_SLOT = 1 << 10  # an outcome is None or one line: a longer one costs a second round


@dataclass(frozen=True)
class Failure:
    """What the other ranks learn of one rank's failed part."""

    rank: int
    kind: str  # the error's `kind` (a store error's, e.g. "memory_limit"), else ""
    stores: bool  # a StateError: the stores' fault, which an older snapshot or the durable tier may serve
    why: str  # "ErrorType: message"


@dataclass
class Failed:
    """What `agree` tells every rank when some rank's part failed: `failures` in rank order, and this
    rank's own exception (`mine`, None when its part succeeded)."""

    failures: list[Failure]
    me: int
    mine: BaseException | None

    @property
    def first(self) -> Failure:
        return self.failures[0]

    @property
    def mine_first(self) -> bool:
        """Whether this rank is the first that failed (then its own exception is the one to raise)."""
        return self.mine is not None and self.first.rank == self.me

    def raised(self, what: str) -> BaseException:
        """What this rank raises: its own exception, else one naming the first rank that could not `what`
        (every rank takes the same way out)."""
        return self.mine or StateError(f"rank {self.first.rank} could not {what}: {self.first.why}")

    @property
    def stores_only(self) -> bool:
        """Whether every failure is the stores' fault (else a bug, which no fallback may hide)."""
        return all(f.stores for f in self.failures)


def attempt(fn: Callable[[], object]) -> Exception | None:
    """Run this rank's part; what it raises is returned, for `agree` to tell the others."""
    try:
        fn()
    except Exception as e:  # every rank learns of it in `agree`, so none waits for the others forever
        return e
    return None


def agree(error: BaseException | None, group: world.Group = None) -> Failed | None:
    """One all-gather of every rank's outcome (`error`: this rank's, from `attempt`): every rank gets the
    same answer, None when all succeeded. A broken group raises `GroupError` (then no rank learns more)."""
    outcomes = world.all_gather(_outcome(error), group, slot=OUTCOME_SLOT)
    failures = [Failure(r, *o) for r, o in enumerate(outcomes) if o is not None]
    return Failed(failures, world.rank(group), error) if failures else None


def settle(error: BaseException | None, then: Callable[[], object], group: world.Group = None) -> Settled:
    """`agree`, then rank 0's part `then` (a commit) when every rank succeeded, then `agree` on that: in
    one gather to rank 0 and one broadcast instead of two all-gathers. Every rank learns the same: which
    ranks failed, and whether `then` ran."""
    own: list[BaseException] = []  # rank 0's exception from `then`: raised as its own

    def decide(outcomes: list[tuple[str, bool, str] | None]) -> tuple[list[Failure], bool]:
        failures = [Failure(r, *o) for r, o in enumerate(outcomes) if o is not None]
        if failures:
            return failures, False
        e = attempt(then)
        own.extend([e] if e is not None else [])
        return ([Failure(0, *_outcome(e))] if e is not None else []), True

    failures, ran = world.gather_then(_outcome(error), decide, group, slot=OUTCOME_SLOT)
    mine = own[0] if own else error
    return Settled(Failed(failures, world.rank(group), mine) if failures else None, ran)


@dataclass
class Settled:
    """What `settle` tells every rank: what failed (None: nothing) and whether rank 0's part ran."""

    failed: Failed | None
    ran: bool


def _outcome(error: BaseException | None) -> tuple[str, bool, str] | None:
    """What the other ranks learn of this rank's part: None when it succeeded."""
    if error is None:
        return None
    return getattr(error, "kind", ""), isinstance(error, StateError), _line(error)


def _line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
