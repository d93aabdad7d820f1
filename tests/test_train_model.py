"""The model matches the symbolic PTC's names and shapes, stages keep global names, heads split cleanly."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from tenplex.ptc import PTCError, preset, stage_layers  # noqa: E402
from tenplex.ptc.gpt import param_shapes  # noqa: E402
from tenplex.ptc.layout import Layout, LayoutError, layouts  # noqa: E402
from tenplex.train.model import GPT  # noqa: E402
from tenplex.train.optim import WarmupCosine, build_optimizer, init_state  # noqa: E402


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("tied", [False, True])
def test_names_and_shapes_are_the_ptc_ones(name: str, tied: bool) -> None:
    cfg = replace(preset(name), tied=tied)
    got = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}
    want = {fqn: shape for fqn, shape, _, _ in param_shapes(cfg)}
    assert got == want
    assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.param_count()


def test_tied_head_reuses_the_embedding() -> None:
    torch.manual_seed(0)
    model = GPT(replace(preset("tiny"), tied=True))
    x = torch.randint(0, 256, (2, 8))
    logits = model(x)
    assert logits.shape == (2, 8, 256)
    logits.sum().backward()
    assert model.tok_emb.weight.grad is not None and model.head is None


def test_same_seed_same_model() -> None:
    torch.manual_seed(3)
    a = GPT(preset("tiny")).state_dict()
    torch.manual_seed(3)
    b = GPT(preset("tiny")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stages_keep_global_names_and_compose(pp: int) -> None:
    cfg = preset("small")
    torch.manual_seed(0)
    full = GPT(cfg)
    names = set(full.state_dict())
    seen: set[str] = set()
    x = torch.randint(0, cfg.vocab, (2, 16))
    h = x
    for stage in range(pp):
        torch.manual_seed(0)
        part = GPT(cfg).keep_stage(pp, stage)
        keys = set(part.state_dict())
        assert not keys & seen and keys <= names
        assert {k.split(".")[1] for k in keys if k.startswith("blocks.")} == {
            str(i) for i in stage_layers(cfg.layers, pp, stage)
        }
        seen |= keys
        h = part(h)
    assert seen == names
    torch.testing.assert_close(h, full(x), rtol=0, atol=0)


def test_attention_split_by_heads_is_a_contiguous_row_slice() -> None:
    """Shard(0) of qkv and Shard(1) of proj over tp ranks = whole heads per rank: partial outputs add up."""
    cfg = preset("tiny")
    torch.manual_seed(0)
    attn = GPT(cfg).blocks["0"].attn
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_()
    x = torch.randn(2, 8, cfg.hidden)
    full = attn(x)
    for tp in (2, 4):
        total = attn.proj.bias.clone()
        for r in range(tp):
            shard = type(attn)(cfg)
            rows = slice(r * 3 * cfg.hidden // tp, (r + 1) * 3 * cfg.hidden // tp)
            cols = slice(r * cfg.hidden // tp, (r + 1) * cfg.hidden // tp)
            shard.qkv = torch.nn.Linear(cfg.hidden, 3 * cfg.hidden // tp)
            shard.proj = torch.nn.Linear(cfg.hidden // tp, cfg.hidden)
            with torch.no_grad():
                shard.qkv.weight.copy_(attn.qkv.weight[rows])
                shard.qkv.bias.copy_(attn.qkv.bias[rows])
                shard.proj.weight.copy_(attn.proj.weight[:, cols])
                shard.proj.bias.zero_()
            total = total + shard(x)
        torch.testing.assert_close(total, full, rtol=1e-4, atol=1e-4)  # fp32 sum order only


def test_warmup_cosine() -> None:
    f = WarmupCosine(warmup=4, total=14, min_ratio=0.1)
    assert [f(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(f(9), 0.1 + 0.9 * 0.5)
    assert math.isclose(f(14), 0.1) and math.isclose(f(100), 0.1)


def test_weight_decay_only_on_matrices() -> None:
    opt = build_optimizer(GPT(preset("tiny")), lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("amsgrad", [False, True])
def test_a_fresh_optimizers_state_is_what_dcps_step_at_lr_0_makes(amsgrad: bool) -> None:
    """`init_state` (no step run) and DCP's own initialization (a step at lr 0 with zero gradients) give
    the same state dict bit for bit (keys, dtypes, values), a frozen parameter no state, and leave every
    parameter as it was."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def state(ours: bool) -> tuple[dict, dict]:
        torch.manual_seed(0)
        model = GPT(preset("tiny"))
        model.pos_emb.weight.requires_grad_(False)
        opt = build_optimizer(model, lr=1e-3)
        for g in opt.param_groups:
            g["amsgrad"] = amsgrad
        if ours:
            init_state(opt)
        return get_optimizer_state_dict(model, opt), {k: v.clone() for k, v in model.state_dict().items()}

    (dcp, before), (mine, after) = state(False), state(True)
    flat = lambda sd: {f"{p}.{k}": v for p, st in sd["state"].items() for k, v in st.items()}  # noqa: E731
    a, b = flat(dcp), flat(mine)
    assert sorted(a) == sorted(b) and not any(k.startswith("pos_emb.") for k in a), sorted(a)[:4]
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert dcp["param_groups"] == mine["param_groups"]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_layouts_and_errors() -> None:
    tiny = preset("tiny")  # 2 layers, 4 heads
    got = {(lay.dp, lay.tp, lay.pp) for lay in layouts(tiny, 4)}
    assert got == {(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2)}
    assert {(lay.dp, lay.tp, lay.pp) for lay in layouts(tiny, 3)} == {(3, 1, 1)}
    with pytest.raises(PTCError, match="heads"):
        Layout(1, 3, 1).check(tiny)
    with pytest.raises(LayoutError, match="needs 4 ranks"):
        Layout(2, 2, 1).check(tiny, world=2)
    with pytest.raises(LayoutError, match="tied"):
        Layout(1, 2, 1).check(replace(tiny, tied=True))
    Layout(1, 2, 1).check(replace(tiny, tied=True), reference=False)  # the architecture allows it
    assert Layout(2, 1, 2) not in layouts(tiny, 4, global_batch=3)  # dp must divide the global batch
    assert Layout(1, 1, 3) not in layouts(preset("small"), 3, even_stages=True)  # 4 layers in 3 stages
    assert Layout(1, 1, 3) in layouts(preset("small"), 3)
    with pytest.raises(LayoutError, match="looks like"):
        Layout.from_dict({"dp": "two"})
    assert Layout.from_dict(Layout(2, 1, 2, True).to_dict()) == Layout(2, 1, 2, True)
    with pytest.raises(PTCError, match="tied"):
        GPT(replace(tiny, tied=True)).keep_stage(2, 0)
