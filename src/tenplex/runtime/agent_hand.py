"""How an agent hands a round to its host's workers (`runtime/agent.py`'s `Agent` does so): to the kept
workers once they parked; for a change planned at a step, to workers forked ahead, which form the round's
group, build and rehearse a step while the old round trains its last steps, and load on their turn (the
old ranks' final save committed: each rank says so to its own host's agent); a round of new hosts only (a
redeploy) once the hosts of the round before closed it.
"""

from __future__ import annotations

import math
import time

import torch.distributed as dist

from .agent_watch import silent
from .agentconfig import AgentConfig
from .membership import refuses
from .rounds import Round, has, job_key
from .workers import Workers

PARK_TIMEOUT_S = 120.0  # a worker that neither parks nor dies this long after a change is killed, restarted
AHEAD_MIN_S = 1.0  # a round is handed ahead only this long or more before its step (else kept workers win)


class Handing:
    """The agent's part that hands rounds over (the rest is `Agent`'s)."""

    cfg: AgentConfig
    base: dist.Store | None
    workers: Workers
    ahead: bool
    broken: float
    told: tuple[int, int | None] | None
    silent_s: float

    def _hand(self, rnd: Round) -> None:
        """The round to this host's workers. A round of new hosts only (a redeploy: `Round.after`) loads
        once every host of the round before closed it (saved, or failed), or is gone: nothing else holds
        its ranks back from an older snapshot; handed ahead, its workers build meanwhile."""
        if rnd.ahead or not rnd.after:
            self.workers.hand(rnd, go=not rnd.after)
        if not rnd.after:
            return
        assert self.base is not None
        run_id, deadline = self.cfg.run_id, time.monotonic() + PARK_TIMEOUT_S
        # the hosts that left as planned (a lost one saves nothing more)
        keys = {u: job_key(run_id, "closed", rnd.number - 1, u) for u in rnd.after}
        keys = {u: k for u, k in keys.items() if has(self.base, job_key(run_id, "left", u))}
        looks, heard = 0, {}
        while keys and time.monotonic() < deadline:
            looks += 1
            keys = {u: k for u, k in keys.items() if not has(self.base, k)}
            if looks % 25 == 0:  # its host gone (its store refuses) or its agent (silent): it will not say
                gone = [u for u in keys if silent(self.base, run_id, u, heard, self.silent_s) or refuses(u)]
                keys = {u: k for u, k in keys.items() if u not in gone}
            time.sleep(0.02)
        if rnd.ahead:
            self.workers.channel.go(rnd.number)
        else:
            self.workers.hand(rnd)

    def _ahead_pays(self, rnd: Round) -> bool:
        """Whether this agent would hand the next round ahead: on CPUs, for a planned change whose step its
        workers said is far enough ahead (`reached/N`: not said, the step was passed) that the next round's
        workers build (and rehearse) before the old ones reach it."""
        at, left = self.told[1] if self.told is not None else None, self.workers.left_s(rnd)
        going = at is not None and AHEAD_MIN_S <= left < math.inf and not self.workers.ended(rnd)
        return self.ahead and not self.broken and going

    def _take_ahead(self, new: Round, failed: bool) -> bool:
        """Whether the round handed ahead goes, one word for every host of it (`turn/N` in the rendezvous
        store, the first said wins): go where this host's old round ended well or its ranks gave the turn
        (the final save committed), else cancel. Each host deciding alone, one that cancels would leave
        the others' ranks waiting on its killed ones."""
        assert self.base is not None
        word = "go" if not failed or self.workers.channel.went(new.number) else "cancel"
        said = self.base.compare_set(job_key(self.cfg.run_id, "turn", new.number), "", word)
        return self.workers.take_ahead(new, go=said.decode() == "go")

    def _hand_ahead(self, rnd: Round, new: Round) -> bool:
        """A planned change's round to workers forked now, while `rnd`'s train their last steps and save:
        its group forms and its model builds meanwhile, and only the load is left once `rnd` saved (on
        CPUs: `run`). Whether it was handed so."""
        if not (new.ahead and self.ahead) or self.broken:  # else `hand` hands it once `rnd` ended
            return False
        self.workers.hand_ahead(new, rnd)
        return True
