"""A decoder-only GPT whose parameter names and shapes are exactly `tenplex.ptc.gpt.param_shapes`.

Why the layout choices: blocks live in a `ModuleDict` keyed by the global layer number, so a pipeline stage
made by deleting blocks keeps every parameter's global fully-qualified name; the qkv rows are stored
interleaved per head ([heads, 3, head_dim] flattened) so that a contiguous `Shard(0)` over tp hands each
rank whole heads' q, k and v, and the attention code derives its local head count from the local weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ptc import GPTConfig, PTCError, stage_layers


class Attention(nn.Module):
    """Causal self-attention; works unchanged on a tp shard holding a subset of the heads."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # local heads under tensor parallelism
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn_size)
        self.fc2 = nn.Linear(cfg.ffn_size, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The full model, or a pipeline stage of it once `keep_stage` removed what the stage does not own.

    forward takes token ids [B, S] on the first stage and hidden states [B, S, h] elsewhere; it returns
    logits [B, S, V] on the last stage and hidden states elsewhere.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise PTCError(f"hidden {cfg.hidden} is not divisible by {cfg.heads} heads")
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(cfg.hidden)
        self.head: nn.Linear | None = None if cfg.tied else nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation; drawn in a fixed order so one seed gives one model in every layout."""
        std = 0.02
        proj_std = std / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("ln_f"):
                nn.init.ones_(p)
            elif name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
                nn.init.normal_(p, 0.0, proj_std)
            else:
                nn.init.normal_(p, 0.0, std)

    def keep_stage(self, pp: int, stage: int) -> GPT:
        """Delete the blocks, embeddings and head that pipeline stage `stage` of `pp` does not own."""
        if self.cfg.tied and pp > 1:
            raise PTCError("tied embeddings with pipeline parallelism are not supported (use --pp 1)")
        keep = {str(i) for i in stage_layers(self.cfg.layers, pp, stage)}
        for key in [k for k in self.blocks if k not in keep]:
            del self.blocks[key]
        if stage > 0:
            self.tok_emb = None
            self.pos_emb = None
        if stage < pp - 1:
            self.ln_f = None
            self.head = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            assert self.pos_emb is not None
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
            if self.head is not None:
                return self.head(x)
            assert self.tok_emb is not None
            return F.linear(x, self.tok_emb.weight)
        return x
