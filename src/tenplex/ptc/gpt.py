"""The symbolic PTC of a GPT-style transformer for any (dp, tp, pp): plans at any scale, no allocation.

Tensor names follow the reference workload (`tenplex.train`), so a symbolic plan describes exactly what a
real job of the same shape moves: `model.<param fqn>` for parameters and `optim.state.<param fqn>.<key>`
for AdamW state, as `torch.distributed.checkpoint.state_dict` names them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .collection import PTC
from .errors import PTCError
from .layout import check_layout
from .model import ENDS, ModelSpec, Param, model_ptc, stage_layers, stage_of_layer

__all__ = ["PRESETS", "GPTConfig", "gpt_ptc", "gpt_spec", "preset", "stage_layers", "stage_of_layer"]

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    seq: int = 2048
    ffn: int = 0  # 0 means 4 * hidden
    tied: bool = False

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    def param_count(self) -> int:
        """The standard count for this architecture (biases and layer norms included)."""
        h, f, L = self.hidden, self.ffn_size, self.layers
        weights = 4 * h * h + 2 * h * f  # qkv, proj, fc1, fc2
        biases = 3 * h + h + f + h
        per_layer = weights + biases + 4 * h  # and two layer norms
        head = 0 if self.tied else self.vocab * h
        return L * per_layer + (self.vocab + self.seq) * h + 2 * h + head


# GPT-3 (Brown et al. 2020, Table 2.1): n_ctx 2048, the GPT-2 vocabulary, tied input and output
# embeddings. Where the paper's d_model is not divisible by its head count, the shapes follow the ones
# Tenplex and Megatron-LM actually ran: 1.3B uses hidden 2064 (Tenplex's `xl`), 13B uses hidden 5120.
PRESETS: dict[str, GPTConfig] = {
    "gpt3-125m": GPTConfig(12, 768, 12, tied=True),
    "gpt3-350m": GPTConfig(24, 1024, 16, tied=True),
    "gpt3-760m": GPTConfig(24, 1536, 16, tied=True),
    "gpt3-1.3b": GPTConfig(24, 2064, 24, tied=True),
    "gpt3-2.7b": GPTConfig(32, 2560, 32, tied=True),
    "gpt3-6.7b": GPTConfig(32, 4096, 32, tied=True),
    "gpt3-13b": GPTConfig(40, 5120, 40, tied=True),
    "gpt3-175b": GPTConfig(96, 12288, 96, tied=True),
    # byte-level sizes used by the reference workload and the tests
    "tiny": GPTConfig(2, 64, 4, vocab=256, seq=64),
    "small": GPTConfig(4, 256, 8, vocab=256, seq=128),
    "base": GPTConfig(8, 512, 8, vocab=256, seq=256),
    "medium": GPTConfig(12, 768, 12, vocab=256, seq=512),
}

NOMINAL_PARAMS: dict[str, float] = {
    "gpt3-125m": 125e6,
    "gpt3-350m": 350e6,
    "gpt3-760m": 760e6,
    "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9,
    "gpt3-6.7b": 6.7e9,
    "gpt3-13b": 13e9,
    "gpt3-175b": 175e9,
}


def preset(name: str) -> GPTConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise PTCError(f"unknown model {name!r} (known: {', '.join(PRESETS)})") from None


def param_shapes(cfg: GPTConfig) -> Iterator[tuple[str, tuple[int, ...], dict[str, int], str]]:
    """(fqn, shape, tp sharding, where) per parameter; where is 'first', 'last' or the layer number."""
    h, f, v = cfg.hidden, cfg.ffn_size, cfg.vocab
    yield "tok_emb.weight", (v, h), {"tp": 0}, "first"
    yield "pos_emb.weight", (cfg.seq, h), {}, "first"
    for i in range(cfg.layers):
        b = f"blocks.{i}."
        yield b + "ln1.weight", (h,), {}, str(i)
        yield b + "ln1.bias", (h,), {}, str(i)
        yield b + "attn.qkv.weight", (3 * h, h), {"tp": 0}, str(i)
        yield b + "attn.qkv.bias", (3 * h,), {"tp": 0}, str(i)
        yield b + "attn.proj.weight", (h, h), {"tp": 1}, str(i)
        yield b + "attn.proj.bias", (h,), {}, str(i)
        yield b + "ln2.weight", (h,), {}, str(i)
        yield b + "ln2.bias", (h,), {}, str(i)
        yield b + "mlp.fc1.weight", (f, h), {"tp": 0}, str(i)
        yield b + "mlp.fc1.bias", (f,), {"tp": 0}, str(i)
        yield b + "mlp.fc2.weight", (h, f), {"tp": 1}, str(i)
        yield b + "mlp.fc2.bias", (h,), {}, str(i)
    yield "ln_f.weight", (h,), {}, "last"
    yield "ln_f.bias", (h,), {}, "last"
    if not cfg.tied:
        yield "head.weight", (v, h), {"tp": 0}, "last"


def gpt_spec(cfg: GPTConfig) -> ModelSpec:
    """The preset as a model description: what `plan` and `choose` take for a user's model too."""
    params = []
    for fqn, shape, shards, where in param_shapes(cfg):
        tied = fqn == "tok_emb.weight" and cfg.tied
        at: tuple[int | str, ...] = (
            ("first", "last") if tied else (where,) if where in ENDS else (int(where),)
        )
        params.append(Param(fqn, shape, "float32", shards.get("tp"), at))
    return ModelSpec(tuple(params), cfg.layers, cfg.heads, cfg.hidden, cfg.seq, tied=cfg.tied)


def gpt_ptc(
    cfg: GPTConfig,
    dp: int,
    tp: int,
    pp: int,
    *,
    devices_per_host: int = 8,
    devices: Sequence[tuple[str, str]] | None = None,
    zero: int = 0,
    optimizer: bool = True,
) -> PTC:
    """The PTC of `cfg` trained with AdamW on a (pp, dp, tp) mesh (tp fastest, so tp groups share hosts).

    zero=1 shards the AdamW moments over dp (ZeRO-1); zero=3 shards parameters too (FSDP / ZeRO-3). Sharding
    over dp splits dim 0, in mesh order before tp.
    """
    check_layout(cfg, dp, tp, pp)
    where = {"devices_per_host": devices_per_host, "devices": devices}
    return model_ptc(gpt_spec(cfg), dp, tp, pp, **where, zero=zero, optimizer=optimizer)
