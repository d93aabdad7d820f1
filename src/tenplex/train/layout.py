"""A job's (dp, tp, pp) layout and which layouts a model allows; torch-free (the CLI and planner use it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..ptc import GPTConfig, PTCError, check_layout


class LayoutError(PTCError):
    """A (dp, tp, pp) layout the model, the world or the batch cannot take."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}" + ("-fsdp" if self.fsdp else "")

    def check(self, cfg: GPTConfig, world: int | None = None) -> None:
        check_layout(cfg, self.dp, self.tp, self.pp)
        if world is not None and world != self.world:
            raise LayoutError(f"layout {self} needs {self.world} ranks, the job has {world}")
        if cfg.tied and (self.tp > 1 or self.pp > 1):
            raise LayoutError("tied embeddings are supported with tp=1 and pp=1 only")


def valid_layouts(cfg: GPTConfig, world: int) -> list[Layout]:
    """Every (dp, tp, pp) with product `world` that `cfg` allows (tp must divide the heads, pp ≤ layers)."""
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0:
                lay = Layout(world // (tp * pp), tp, pp)
                try:
                    lay.check(cfg, world)
                except PTCError:
                    continue
                out.append(lay)
    return out
