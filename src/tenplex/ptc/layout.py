"""A job's (dp, tp, pp) layout, the rules a layout must follow, and every layout of a world size.

The one place these rules live: the symbolic GPT PTC, the chooser, the reference workload and the CLI all
ask here. Two levels: what the architecture allows (tp divides the heads, pp is at most the layers), and
what the reference workload also runs (tied embeddings only with tp = pp = 1). Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .errors import PTCError

if TYPE_CHECKING:
    from .gpt import GPTConfig


class LayoutError(PTCError):
    """A (dp, tp, pp) layout the model, the world or the batch cannot take."""


def check_layout(cfg: GPTConfig, dp: int, tp: int, pp: int) -> None:
    """Raise a one-line error when the architecture cannot be laid out as (dp, tp, pp)."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"{name} must be a positive integer, got {v!r}")
    if cfg.heads % tp:
        raise LayoutError(f"tp={tp} does not divide the model's {cfg.heads} attention heads")
    if pp > cfg.layers:
        raise LayoutError(f"pp={pp} is more than the model's {cfg.layers} layers")


LAYOUT_KEYS = ("dp", "tp", "pp")


def parse_layout(text: str) -> dict[str, int]:
    """`dp=2,tp=4,pp=2` -> {"dp": 2, "tp": 4, "pp": 2}; unspecified axes are 1."""
    out = dict.fromkeys(LAYOUT_KEYS, 1)
    seen = set()
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in LAYOUT_KEYS or key in seen:
            raise LayoutError(f"malformed layout {text!r}: expected e.g. dp=2,tp=4,pp=2")
        try:
            out[key] = int(value)
        except ValueError:
            raise LayoutError(f"malformed layout {text!r}: {key} must be an integer") from None
        if out[key] < 1:
            raise LayoutError(f"malformed layout {text!r}: {key} must be at least 1")
        seen.add(key)
    if not seen:
        raise LayoutError(f"malformed layout {text!r}: expected e.g. dp=2,tp=4,pp=2")
    return out


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """From {dp, tp, pp[, fsdp]}; missing sizes are 1 (a schedule's `layout: {tp: 2}`)."""
        try:
            return cls(int(d.get("dp", 1)), int(d.get("tp", 1)), int(d.get("pp", 1)), bool(d.get("fsdp")))
        except (TypeError, ValueError, AttributeError):
            raise LayoutError(f"a layout looks like {{dp, tp, pp}}, got {d!r}") from None

    def check(self, cfg: GPTConfig, world: int | None = None, *, reference: bool = True) -> None:
        """The architecture's rules, the world size, and (`reference`) what the reference workload runs."""
        check_layout(cfg, self.dp, self.tp, self.pp)
        if world is not None and world != self.world:
            raise LayoutError(f"layout {self} needs {self.world} ranks, the job has {world}")
        if reference and cfg.tied and (self.tp > 1 or self.pp > 1):
            raise LayoutError("tied embeddings are supported with tp=1 and pp=1 only")

    def allowed(self, cfg: GPTConfig, world: int | None = None, *, reference: bool = True) -> bool:
        try:
            self.check(cfg, world, reference=reference)
        except PTCError:
            return False
        return True


def layouts(
    cfg: GPTConfig,
    world: int,
    *,
    reference: bool = True,
    global_batch: int | None = None,
    even_stages: bool = False,
) -> list[Layout]:
    """Every (dp, tp, pp) with product `world` that `cfg` allows, in (tp, pp) order.

    `reference`: only those the reference workload runs; `global_batch`: only dp that divide it;
    `even_stages`: only pp that divide the layers (the chooser's cost model assumes equal stages).
    """
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp):
                continue
            lay = Layout(world // (tp * pp), tp, pp)
            if global_batch is not None and global_batch % lay.dp:
                continue
            if even_stages and cfg.layers % pp:
                continue
            if lay.allowed(cfg, world, reference=reference):
                out.append(lay)
    return out
