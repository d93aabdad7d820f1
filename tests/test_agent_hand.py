"""When an agent proposes to hand the next round ahead (`runtime/agent_hand.py`): only for a change planned at
a step its workers said is at least `AHEAD_MIN_S` away, never once the step was passed (its workers then say
nothing, and parked workers are quicker than forks), after a break, or with `--no-ahead`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from tenplex.runtime.agent_hand import AHEAD_MIN_S, Handing


@dataclass
class Said:
    """What an agent's workers said of the round: seconds to the asked step (inf: nothing), who parked."""

    left: float = math.inf
    parked: dict = field(default_factory=dict)

    def left_s(self, rnd: object) -> float:
        return self.left

    def ended(self, rnd: object) -> dict:
        return self.parked


def _agent(left: float, at: int | None = 40, ahead: bool = True, broken: float = 0.0, parked=None) -> Handing:
    agent = Handing()
    agent.workers, agent.ahead, agent.broken = Said(left, parked or {}), ahead, broken  # type: ignore[assignment]
    agent.told = (3, at)
    return agent


@pytest.mark.parametrize(
    ("agent", "pays"),
    [
        (_agent(AHEAD_MIN_S + 1), True),
        (_agent(AHEAD_MIN_S), True),
        (_agent(AHEAD_MIN_S / 2), False),  # a fork would still build when the old round ends
        (_agent(math.inf), False),  # the step was passed (or never said): the workers park at once
        (_agent(5.0, at=None), False),  # at the next step boundary
        (_agent(5.0, broken=1.0), False),
        (_agent(5.0, ahead=False), False),  # --no-ahead, or an accelerator
        (_agent(5.0, parked={0: {"outcome": "stopped"}}), False),
    ],
)
def test_an_agent_proposes_a_round_ahead_only_with_time_to_build_it(agent: Handing, pays: bool) -> None:
    assert agent._ahead_pays(None) is pays  # type: ignore[arg-type]
