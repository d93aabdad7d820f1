import itertools
import math
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import mesh_placements, meshes, placements, tensor_set
from tenplex.ptc import (
    PRESETS,
    PTC,
    Box,
    Mesh,
    Placement,
    PTCError,
    TensorMeta,
    chunk_bounds,
    gpt_ptc,
    item_size,
    preset,
    stage_layers,
)
from tenplex.ptc.gpt import NOMINAL_PARAMS


def test_box_algebra():
    a = Box((0, 2), (4, 6))
    b = Box((3, 0), (8, 3))
    assert a.shape == (4, 4) and a.volume == 16
    assert a.intersect(b) == Box((3, 2), (4, 3))
    assert a.intersect(Box((4, 0), (5, 9))) is None
    inner = Box((1, 3), (3, 5))
    local = inner.relative_to(a)
    assert local == Box((1, 1), (3, 3))
    assert local.shifted(a) == inner
    assert Box.from_json(a.to_json()) == a
    assert Box((), ()).volume == 1 and Box((), ()).intersect(Box((), ())) == Box((), ())
    with pytest.raises(PTCError, match="invalid box"):
        Box((2,), (1,))
    with pytest.raises(PTCError, match="not inside"):
        b.relative_to(a)
    with pytest.raises(PTCError, match="rank 2 and 1"):
        a.overlaps(Box((0,), (9,)))


@st.composite
def box_pairs(draw):
    ndim = draw(st.integers(0, 3))

    def one():
        ranges = [sorted(draw(st.lists(st.integers(0, 6), min_size=2, max_size=2))) for _ in range(ndim)]
        return Box(tuple(a for a, _ in ranges), tuple(b for _, b in ranges))

    return one(), one()


@given(box_pairs())
@settings(max_examples=300, deadline=None)
def test_overlaps_is_a_nonempty_intersection(pair):
    a, b = pair
    assert a.overlaps(b) == (a.intersect(b) is not None) == b.overlaps(a)


@given(st.integers(0, 50), st.integers(1, 9))
@settings(deadline=None)
def test_chunk_bounds_match_torch_chunk(size, parts):
    import torch  # the one reference the PTC core must agree with

    chunks = torch.arange(size).chunk(parts)  # may return fewer than `parts` pieces: the rest are empty
    expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
    got = [chunk_bounds(size, parts, i) for i in range(parts)]
    assert [g for g in got if g[1] > g[0]] == expected
    assert all(a == b == size for a, b in got[len(expected) :])


def test_mesh_coordinates_and_hosts():
    m = Mesh.build({"pp": 2, "dp": 3, "tp": 2}, devices_per_host=4)
    assert m.size == 12
    assert m.coords(0) == (0, 0, 0) and m.coords(1) == (0, 0, 1) and m.coords(2) == (0, 1, 0)
    assert all(m.rank(m.coords(r)) == r for r in range(m.size))
    assert m.hosts[3] == "h0" and m.hosts[4] == "h1"
    assert m.ranks_where({0: 1, 2: 0}) == [6, 8, 10]
    with pytest.raises(PTCError, match="distinct names"):
        Mesh.build((("dp", 2), ("dp", 2)))
    with pytest.raises(PTCError, match="positive integer"):
        Mesh.build({"dp": 0})
    with pytest.raises(PTCError, match="own device id"):
        Mesh((("dp", 2),), ("a", "a"), ("h", "h"))


def test_placement_boxes_follow_chunk_and_mesh_order():
    m = Mesh.build({"dp": 2, "tp": 3})
    shape = (10, 4)
    p = Placement.of(dp=0, tp=0)  # dp splits dim 0 first, then tp splits each half
    boxes = [p.box(m, shape, m.coords(r)) for r in range(m.size)]
    assert [b.start[0] for b in boxes] == [0, 2, 4, 5, 7, 9]
    assert [b.stop[0] for b in boxes] == [2, 4, 5, 7, 9, 10]
    uneven = Placement.of(tp=1)
    assert [uneven.box(m, (3, 4), m.coords(r)).shape for r in range(3)] == [(3, 2), (3, 2), (3, 0)]
    with pytest.raises(PTCError, match="has 2 dims"):
        Placement.of(tp=2).check(m, shape, "x")
    with pytest.raises(PTCError, match="no axis"):
        Placement.of(ep=0).check(m, shape, "x")


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_pieces_partition_every_tensor(data):
    mesh = data.draw(meshes())
    for meta in data.draw(tensor_set()):
        p = data.draw(mesh_placements(mesh, meta.shape))
        ptc = PTC.build(mesh, [(meta, p)])
        count = np.zeros(meta.shape, dtype=np.int64)
        for piece in ptc.pieces(meta.name):
            count[piece.box.slices()] += 1
            for r in piece.holders:
                assert p.holds(mesh, mesh.coords(r))
                assert p.box(mesh, meta.shape, mesh.coords(r)) == piece.box
        assert (count == 1).all()
        # every rank's shards agree with the pieces
        held = {(s.tensor, s.box, s.rank) for r in range(mesh.size) for s in ptc.shards(r)}
        assert held == {(s.tensor, s.box, s.rank) for s in ptc.all_shards()}


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3)
    ),
    max_leaves=10,
)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


@given(st.data(), st.dictionaries(st.text(max_size=6), VALUES, max_size=4))
@settings(max_examples=60, deadline=None)
def test_manifest_round_trips_exactly(data, values):
    mesh = data.draw(meshes())
    metas = data.draw(tensor_set())
    ptc = PTC.build(mesh, [(m, data.draw(placements(mesh, m.shape))) for m in metas], values)
    back = PTC.loads(ptc.dumps())
    assert back.mesh == ptc.mesh and back.tensors == ptc.tensors and back.placements == ptc.placements
    assert _same(back.values, ptc.values)
    assert back.dumps() == ptc.dumps()
    again = pickle.loads(pickle.dumps(ptc))  # how a snapshot's PTC reaches the other ranks
    assert again.mesh == ptc.mesh and again.tensors == ptc.tensors and again.placements == ptc.placements
    assert _same(again.values, ptc.values)


def test_manifest_errors_are_clear():
    with pytest.raises(PTCError, match="not valid JSON"):
        PTC.loads("{")
    with pytest.raises(PTCError, match="not a tenplex PTC manifest"):
        PTC.loads('{"format": "other"}')
    with pytest.raises(PTCError, match="version 99"):
        PTC.loads('{"format": "tenplex.ptc", "version": 99}')
    with pytest.raises(PTCError, match="unknown dtype"):
        TensorMeta("x", (2,), "complex7")
    with pytest.raises(PTCError, match="cannot hold"):
        PTC.build(Mesh.build({"dp": 1}), [], {"x": object()}).dumps()


def test_item_sizes():
    assert item_size("bfloat16") == 2 and item_size("float64") == 8 and item_size("bool") == 1


@pytest.mark.parametrize("name", list(NOMINAL_PARAMS))
def test_gpt3_presets_match_the_standard_parameter_formula(name):
    cfg = PRESETS[name]
    h, L, V, S = cfg.hidden, cfg.layers, cfg.vocab, cfg.seq
    formula = 12 * L * h * h + 13 * L * h + (V + S) * h + 2 * h  # tied embeddings
    assert cfg.param_count() == formula
    assert abs(formula / NOMINAL_PARAMS[name] - 1) < 0.12, formula
    ptc = gpt_ptc(cfg, 1, 1, 1, optimizer=False)
    assert sum(math.prod(m.shape) for m in ptc.tensors.values()) == formula


@pytest.mark.parametrize("tied", [False, True])
def test_symbolic_gpt_layout(tied):
    cfg = preset("tiny").__class__(layers=4, hidden=32, heads=4, vocab=100, seq=16, tied=tied)
    ptc = gpt_ptc(cfg, dp=2, tp=2, pp=2, devices_per_host=4)
    params = {n: m for n, m in ptc.tensors.items() if n.startswith("model.")}
    assert sum(math.prod(m.shape) for m in params.values()) == cfg.param_count()
    place = ptc.placements
    assert place["model.blocks.0.attn.qkv.weight"] == Placement.of(0, tp=0)
    assert place["model.blocks.3.attn.proj.weight"] == Placement.of(1, tp=1)
    assert place["model.blocks.1.ln1.weight"] == Placement.of(0)
    assert place["model.tok_emb.weight"].stages == ((0, 1) if tied else (0,))
    assert ("model.head.weight" in ptc.tensors) is not tied
    assert place["optim.state.blocks.2.mlp.fc1.weight.exp_avg"] == Placement.of(1, tp=0)
    assert ptc.tensors["optim.state.blocks.2.mlp.fc1.weight.step"].shape == ()
    # ZeRO-1 shards the moments over dp, ZeRO-3 the parameters too
    z1 = gpt_ptc(cfg, 2, 2, 2, zero=1)
    assert z1.placements["optim.state.blocks.0.mlp.fc2.weight.exp_avg"] == Placement.of(0, dp=0, tp=1)
    assert z1.placements["model.blocks.0.mlp.fc2.weight"] == Placement.of(0, tp=1)
    z3 = gpt_ptc(cfg, 2, 2, 2, zero=3)
    assert z3.placements["model.blocks.0.mlp.fc2.weight"] == Placement.of(0, dp=0, tp=1)


def test_stage_layers_cover_all_layers():
    for layers in range(1, 10):
        for pp in range(1, layers + 1):
            got = [i for s in range(pp) for i in stage_layers(layers, pp, s)]
            assert got == list(range(layers))
            assert all(len(stage_layers(layers, pp, s)) >= 1 for s in range(pp))


def test_invalid_gpt_layouts():
    cfg = preset("tiny")
    with pytest.raises(PTCError, match="does not divide"):
        gpt_ptc(cfg, 1, 3, 1)
    with pytest.raises(PTCError, match="more than the model's 2 layers"):
        gpt_ptc(cfg, 1, 1, 3)
    with pytest.raises(PTCError, match="positive integer"):
        gpt_ptc(cfg, 0, 1, 1)
    with pytest.raises(PTCError, match="unknown model"):
        preset("gpt5")


@st.composite
def piece_sets(draw):
    """A shape and boxes inside it: often a split along one dimension (the usual layouts), sometimes with a
    piece moved, widened or dropped, sometimes arbitrary boxes."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 5)) for _ in range(ndim))
    dim = draw(st.integers(0, ndim - 1))
    cuts = sorted(set(draw(st.lists(st.integers(1, shape[dim] - 1), max_size=3)) if shape[dim] > 1 else []))
    edges = [0, *cuts, shape[dim]]
    boxes = []
    for a, b in itertools.pairwise(edges):
        start, stop = [0] * ndim, list(shape)
        start[dim], stop[dim] = a, b
        boxes.append((start, stop))
    for _ in range(draw(st.integers(0, 2))):  # disturb some pieces: gaps, overlaps, both
        start, stop = boxes[draw(st.integers(0, len(boxes) - 1))]
        d = draw(st.integers(0, ndim - 1))
        start[d] = draw(st.integers(0, shape[d] - 1))
        stop[d] = draw(st.integers(start[d] + 1, shape[d]))
    if draw(st.booleans()):
        boxes.append(boxes[-1])
    return shape, [Box(tuple(a), tuple(b)) for a, b in boxes]


@given(piece_sets())
@settings(max_examples=300, deadline=None)
def test_explicit_check_accepts_exactly_the_tilings(case):
    from tenplex.ptc import Explicit, Piece

    shape, boxes = case
    count = np.zeros(shape, np.int64)
    for b in boxes:
        count[b.slices()] += 1
    placement = Explicit(tuple(Piece(b, (0,)) for b in boxes))
    if (count == 1).all():
        placement.check(Mesh.build({"dp": 1}), shape)
    else:
        with pytest.raises(PTCError, match=r"do not tile|overlap"):
            placement.check(Mesh.build({"dp": 1}), shape)


def test_explicit_layouts_must_tile_the_tensor():
    from tenplex.ptc import Explicit, Piece

    mesh = Mesh.build({"dp": 2})
    meta = TensorMeta("w", (4, 2), "float32")
    ok = Explicit((Piece(Box((0, 0), (3, 2)), (0,)), Piece(Box((3, 0), (4, 2)), (1, 0))))
    ptc = PTC.build(mesh, [(meta, ok)])
    assert PTC.loads(ptc.dumps()) == ptc == pickle.loads(pickle.dumps(ptc))
    assert [s.box for s in ptc.shards(0)] == [Box((0, 0), (3, 2)), Box((3, 0), (4, 2))]
    gap = Explicit((Piece(Box((0, 0), (3, 2)), (0,)),))
    with pytest.raises(PTCError, match="do not tile"):
        PTC.build(mesh, [(meta, gap)])
    overlap = Explicit((Piece(Box((0, 0), (3, 2)), (0,)), Piece(Box((2, 0), (3, 2)), (1,))))
    with pytest.raises(PTCError, match="overlap"):
        PTC.build(mesh, [(meta, overlap)])
    with pytest.raises(PTCError, match="outside ranks"):
        PTC.build(mesh, [(meta, Explicit((Piece(Box((0, 0), (4, 2)), (5,)),)))])
