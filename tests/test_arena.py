"""The scratch arena: disjoint, aligned buffers of one mapping, kept alive by their views."""

import gc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenplex.util.arena import ALIGN, Arena


@given(st.lists(st.integers(0, 3 << 20), max_size=12))
def test_buffers_are_disjoint_aligned_and_exactly_sized(sizes):
    arena = Arena(Arena.size_of(sizes))
    bufs = [arena.take(n) for n in sizes]
    for i, (n, b) in enumerate(zip(sizes, bufs)):
        assert b.nbytes == n and b.ctypes.data % ALIGN == 0
        b[:] = i % 251
    for i, b in enumerate(bufs):  # no later buffer wrote over an earlier one
        assert (b == i % 251).all()


def test_taking_more_than_the_capacity_is_refused():
    arena = Arena(100)
    arena.take(64)
    with pytest.raises(ValueError, match="has 36 left, 40 asked"):
        arena.take(40)


def test_a_view_outlives_the_arena():
    view = Arena(8 << 20).take(8 << 20).view(np.float32)
    gc.collect()
    view[:] = 1.5  # the mapping is still there: the view holds it
    assert float(view.sum()) == 1.5 * view.size
