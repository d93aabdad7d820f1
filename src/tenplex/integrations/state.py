"""The state an elastic script hands to `ElasticJob`, for any FSDP2/TP model, and the layout of a phase."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..ptc import TenplexError
from ..train.optim import init_state

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState:
    """`state()` is the job's state dict (model and optimizer through DCP's state-dict API, so that names
    are the same in every layout, plus any stateful `extra` such as the sampler); `restore(state)` hands a
    loaded one back to the model and optimizer; `start_fresh()` undoes what building the first one did.
    `ElasticJob.resume(train_state)` calls whichever of the two applies."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, **extra: Any) -> None:
        self.model, self.optimizer, self.extra = model, optimizer, extra
        self._created_optimizer_state = False

    def __call__(self) -> dict[str, Any]:
        if not self.optimizer.state:  # the optimizer is about to get its state: see start_fresh
            self._created_optimizer_state = True
            init_state(self.optimizer)  # Adam's and AdamW's without DCP's step (others: DCP's)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=OPTIONS)
        return {"model": model_sd, "optim": optim_sd, **self.extra}

    def start_fresh(self) -> None:
        """No snapshot to resume: the optimizer goes back to having no state, as in the script without
        tenplex. A fresh optimizer's state is what one zero-gradient step at lr 0 makes (DCP's
        `get_state_dict` runs that step, `train.optim.init_state` makes the same state for Adam and AdamW);
        parameters stay, but AdamW's step count starts at 1 and its bias correction then differs from the
        first real step on (`tests/test_user_script.py` holds the losses to the plain script's)."""
        if self._created_optimizer_state:
            self.optimizer.state.clear()
            self._created_optimizer_state = False

    def restore(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=OPTIONS,
        )


def layout_for(world: int, tp_table: str = "") -> tuple[int, int]:
    """(dp, tp) for `world` ranks from a script's `--tp` table ("4:2,6:3": tensor parallelism 2 on 4
    ranks, 3 on 6; any other world size is pure data parallelism)."""
    table = {}
    for entry in filter(None, tp_table.split(",")):
        n, _, t = entry.partition(":")
        try:
            table[int(n)] = int(t)
        except ValueError:
            raise TenplexError(f"--tp {tp_table!r}: expected WORLD:TP entries such as 4:2") from None
    tp = table.get(world, 1)
    if tp < 1 or world % tp:
        raise TenplexError(f"tp={tp} does not divide the world of {world} ranks")
    return world // tp, tp
